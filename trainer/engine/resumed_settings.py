"""The settings a run takes from the checkpoint it resumes rather than from its config: the job's
global batch (kept on any world size, ``trainer.elastic.global_batch``) and the seed of its data
order and views (kept, so that a checkpoint continues the sample sequence it was on; checkpoints
written when ``data.loader.seed`` defaulted to 0 resume as they did)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from trainer.checkpoint.safe_load import load_data
from trainer.elastic.global_batch import BatchSplit, split_global_batch
from trainer.elastic.smallest_size_memory import check_smallest_size_memory
from trainer.elastic.world_range import check_elastic_range
from trainer.parallel.elastic_range import world_sizes_from_environment

SAMPLER_COMPONENT = "components/sampler"  # the training sampler's state in a checkpoint (its seed among it)
CPU = torch.device("cpu")


@dataclass(frozen=True)
class RunSettings:
    config: object  # the JobConfig this run trains with
    split: BatchSplit
    notes: tuple[str, ...]  # what was taken from the checkpoint, for the log


def recorded_loader_seed(checkpoint: Path) -> int | None:
    """The data-order seed the checkpoint's sampler recorded (None: it recorded none)."""
    files = sorted((Path(checkpoint) / SAMPLER_COMPONENT).glob("rank-*.pt"))
    if not files:
        return None
    seed = load_data(files[0], map_location="cpu").get("seed")
    return None if seed is None else int(seed)


def settings_for_this_run(config, world_size: int, resumed: Path | None, resumed_meta: dict | None,
                          device: torch.device = CPU, num_instances: int | None = None) -> RunSettings:
    """``config`` with the per-rank batch and the loader seed this run must use on ``world_size`` ranks.
    On the first start of an elastic launch, also the memory of ``device`` (the rank's) at the range's
    smallest size, planned for ``num_instances`` (None: the training shards' count)."""
    loader = config.data.loader
    saved = (resumed_meta.get("global_batch"), resumed_meta["world_size"]) if resumed_meta else (None, None)
    world_sizes = world_sizes_from_environment()  # an elastic launch's range (None: a job of fixed size)
    largest = max(world_sizes) if world_sizes else None
    # every world size of the range must split what is split over the ranks: refused now, not at a shrink
    check_elastic_range(saved[0] or loader.batch_size * (largest or world_size), world_sizes,
                        config.objective.sizes_split_over_ranks())
    split = split_global_batch(loader.batch_size, world_size, *saved, largest_world_size=largest)
    notes = [split.describe()] if resumed is not None or split.changed else []
    # the first start only: a restart keeps the global batch checked then (and may find the last run's memory)
    if resumed is None and (memory := check_smallest_size_memory(config, world_sizes, device, num_instances)):
        notes.append(memory)
    if split.changed:
        loader = replace(loader, batch_size=split.per_rank)
    seed = recorded_loader_seed(resumed) if resumed is not None else None
    if seed is not None and seed != loader.seed:
        notes.append(f"data.loader.seed {seed}, the checkpoint's, not {loader.seed}: a resumed run continues the data "
                     "order and views it was on (start a new run for another seed)")
        loader = replace(loader, seed=seed)
    if loader is not config.data.loader:
        config = replace(config, data=replace(config.data, loader=loader))
    return RunSettings(config, split, tuple(notes))
