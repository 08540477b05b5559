"""An elastic job's whole range checked at its start: every world size it may shrink or grow to
must split the global batch, and every setting an objective splits evenly over the ranks (SwAV's
queue).  Otherwise the job trains for days at its first size and every rank exits 2 at the first
node lost (``trainer.elastic.global_batch`` refuses the split then).  The ranks learn the range
from the launcher (``trainer.parallel.elastic_range``)."""

from __future__ import annotations

import math

from trainer.elastic.global_batch import GlobalBatchError


def nearest_common_multiple(value: int, sizes: tuple[int, ...]) -> int:
    """The multiple of every one of ``sizes`` nearest ``value`` (the larger one on a tie; never 0)."""
    step = math.lcm(*sizes)
    below = (value // step) * step
    above = below + step
    return above if below == 0 or above - value <= value - below else below


def check_elastic_range(global_batch: int, world_sizes: tuple[int, ...] | None, split_settings: dict[str, int]
                        ) -> None:
    """Refuse (``GlobalBatchError``, exit 2) a range of ``world_sizes`` some of which cannot split the
    ``global_batch`` or one of ``split_settings`` (``{setting: value}``, what an objective divides
    over the ranks)."""
    if not world_sizes:
        return
    smallest, largest = min(world_sizes), max(world_sizes)
    problems = []
    bad = [size for size in world_sizes if global_batch % size]
    if bad:
        fitting = nearest_common_multiple(global_batch, world_sizes)
        problems.append(
            f"the global batch {global_batch} does not split over {', '.join(map(str, bad))} ranks. The nearest global "
            f"batch that every size splits is {fitting}: set data.loader.batch_size={fitting // largest} (the "
            f"per-rank batch at the largest size, {largest} ranks; {fitting // smallest} per rank at the smallest, "
            f"{smallest} ranks: check its memory with `instcls plan --config CONFIG --ranks {smallest}`)")
    for setting, value in split_settings.items():
        bad = [size for size in world_sizes if value % size]
        if bad:
            problems.append(f"{setting}={value} does not split over {', '.join(map(str, bad))} ranks: use "
                            f"{nearest_common_multiple(value, world_sizes)}, which every size splits")
    if problems:
        sizes = ", ".join(map(str, world_sizes))
        raise GlobalBatchError(
            f"the elastic range of this launch ({smallest} to {largest} ranks: {sizes}) includes world sizes this job "
            f"cannot run at: {'; '.join(problems)}. Or narrow --nnodes MIN:MAX to sizes that split them (a "
            "checkpoint's global batch is kept on resume: start a new run for another)")
