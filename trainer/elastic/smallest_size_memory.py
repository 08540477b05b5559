"""An elastic job's memory at the smallest size of its range, checked at its first start.

The global batch is kept on every world size (``trainer.elastic.global_batch``), so at MIN nodes a
rank holds MAX / MIN times the images it holds at MAX nodes, and a larger shard of a sharded
classifier.  A job that fits at its first size but not at MIN trains until the first node is lost,
then runs out of memory at every restart until ``--max-restarts`` are spent.  So each GPU rank plans
its peak at the smallest size with the planner (``instcls plan``'s estimate) and compares it with the
free memory of its device (``torch.cuda.mem_get_info``) less ``parallel.elastic.memory_margin`` of
the device's total: a job that does not fit is refused before step 1 (exit 2).

At the first start only (a run that resumes no checkpoint), as the range's other checks split the
job's own global batch then: a restart keeps the global batch the first start checked, and its
device may still hold memory that the previous run's process is giving back, which would refuse a
job that fits.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from trainer.objectives import NoMemoryPlan
from trainer.planning.plan_from_config import plan_input_from_config
from trainer.planning.plan_input import GIB
from trainer.planning.prediction import total


class SmallestSizeMemoryError(ValueError):
    """The job's per-rank batch at the smallest size of its elastic range does not fit the GPU."""


def planned_peak(config, world_size: int, per_rank_batch: int, num_instances: int | None) -> int:
    """The planner's peak device memory of one rank of ``config`` on ``world_size`` ranks of
    ``per_rank_batch`` images (N from the training shards when ``num_instances`` is None)."""
    loader = replace(config.data.loader, batch_size=per_rank_batch)
    config = replace(config, data=replace(config.data, loader=loader))
    return total(plan_input_from_config(config, world_size, num_instances))


def check_smallest_size_memory(config, world_sizes: tuple[int, ...] | None, device: torch.device,
                               num_instances: int | None) -> str | None:
    """Refuse (``SmallestSizeMemoryError``) a first start of an elastic launch over ``world_sizes``
    whose rank at the smallest size would not fit ``device``.  Returns a line for the run's log (what
    was checked, or why it was not), None when there is nothing to check (a job of fixed size, or
    ``parallel.elastic.memory_check`` off).  ``config``: the job's, ``data.loader.batch_size`` the
    per-rank batch at the largest size."""
    settings = config.parallel.elastic
    if not world_sizes or not settings.memory_check:
        return None
    smallest, largest = min(world_sizes), max(world_sizes)
    global_batch = config.data.loader.batch_size * largest
    per_rank = global_batch // smallest
    if device.type != "cuda" or not torch.cuda.is_available():
        return (f"elastic memory check skipped: this rank runs on {device.type}, not a GPU (the check compares the "
                f"planned peak at {smallest} ranks with a GPU's free memory)")
    try:
        peak = planned_peak(config, smallest, per_rank, num_instances)
    except NoMemoryPlan:
        return (f"elastic memory check skipped: objective {config.objective.name!r} has no memory plan to estimate "
                f"its peak at {smallest} ranks with")
    free, capacity = torch.cuda.mem_get_info(device)
    margin = int(settings.memory_margin * capacity)
    figures = (f"the planner's peak per rank at {smallest} ranks x {per_rank} images (the global batch {global_batch}) "
               f"is {peak / GIB:.2f} GiB, and {device} has {free / GIB:.2f} GiB free of {capacity / GIB:.2f} GiB, "
               f"less a margin of {margin / GIB:.2f} GiB (parallel.elastic.memory_margin={settings.memory_margin})")
    if peak + margin > free:
        raise SmallestSizeMemoryError(
            f"the elastic range of this launch ({smallest} to {largest} ranks) does not fit this GPU at its smallest "
            f"size: {figures}. The job would train until the first lost node, then run out of memory at every "
            f"restart on {smallest} ranks. Set a smaller data.loader.batch_size (now {config.data.loader.batch_size} "
            f"per rank at {largest} ranks; one that every size of the range splits), a larger MIN in --nnodes MIN:MAX, "
            "or, if the estimate is wrong for this job, set parallel.elastic.memory_check=false. The plan: `instcls "
            f"plan --config CONFIG --ranks {smallest} --set data.loader.batch_size={per_rank}`")
    return f"elastic memory check: fits at the smallest size of the range: {figures}"
