"""Reading shard sets while training: samplers decide which ids each rank reads at each step,
loaders (DALI, or torchvision as the fallback) decode and augment them into batches."""
