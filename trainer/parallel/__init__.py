"""Process groups and the autograd-aware collectives of the DHP classifier.

The package's names are imported on first use: `instcls launch`, the container's main process,
imports modules of this package but never torch (a second of CPU and more on every pod start).
"""

__all__ = ["ParallelDims", "init_distributed", "single_process_dims"]


def __getattr__(name: str):
    if name in __all__:
        from trainer.parallel import dims

        return getattr(dims, name)
    raise AttributeError(f"module 'trainer.parallel' has no attribute {name!r}")
