"""Where a shard set's bytes live: a local directory or an ``s3://bucket/prefix``, read by byte range."""
