"""Making shard sets: sources in, WebDataset tars, indexes, sample table and manifest out
(parallel parts, resumable), merging parts, upgrading and validating shard sets."""
