"""Process groups and the autograd-aware collectives of the DHP classifier."""

from trainer.parallel.dims import ParallelDims, init_distributed, single_process_dims

__all__ = ["ParallelDims", "init_distributed", "single_process_dims"]
