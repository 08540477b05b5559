"""The settings of an elastic launch (``--nnodes MIN:MAX``): ``parallel.elastic`` in a job config.

In the config layer, beside the job config that holds them; ``trainer.elastic`` reads them."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config_building import ConfigError


@dataclass(frozen=True)
class ElasticSettings:
    """Attributes:
    memory_check: at the first start of an elastic launch, refuse (exit 2) a job whose peak memory
        per rank at the smallest size of the range, as the planner estimates it (the largest
        per-rank batch and classifier shard), does not fit the free memory of the rank's GPU less
        ``memory_margin`` (``trainer.elastic.smallest_size_memory``).  Set it to false where the
        estimate is wrong for your job.  CPU ranks skip it.
    memory_margin: the fraction of the GPU's total memory kept free beside the estimate, for what the
        planner leaves out (the allocator's fragmentation, libraries' workspaces).
    """

    memory_check: bool = True
    memory_margin: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.memory_check, bool):
            raise ConfigError(f"parallel.elastic.memory_check={self.memory_check!r} is invalid: use true or false")
        margin = self.memory_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:  # NaN too
            raise ConfigError(f"parallel.elastic.memory_margin={margin!r} is invalid: use a fraction of the GPU's "
                              "total memory in [0, 1), such as 0.1")
