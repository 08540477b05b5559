"""The on-disk shard-set format: manifest, sample table, tar indexes and labels (read by every
later stage; imports nothing else of data_pipeline)."""
