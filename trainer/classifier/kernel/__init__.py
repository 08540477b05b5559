"""The chunked sharded cosine-softmax kernel: logits chunk by chunk, the two reductions over the
ranks, per-sample losses, and the row gradients."""
