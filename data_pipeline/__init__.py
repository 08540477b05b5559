"""WebDataset shards of an instance-classification dataset, and the loaders that read them."""
