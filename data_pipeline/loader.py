"""What every loader returns, how ranks split an epoch, and the loader factory.

Epoch semantics (identical for the DALI and the fallback loader):

* The shard order of epoch e is a permutation drawn from (seed, e), the same on every rank, so
  any epoch can be reproduced on its own (exact resume).  The samples in that order are split
  into contiguous ranges: rank r of S reads ``[N*r // S, N*(r+1) // S)`` (DALI's sharding rule).
* Iterating a loader runs one epoch and moves on to the next; ``set_epoch(e)`` jumps to epoch e.
* ``last_batch="pad"`` (default): every rank runs ``ceil(max range / batch)`` steps; batches past
  the end of a rank's range are filled by repeating samples, and ``Batch.valid`` is False on those
  repeats, so every instance id appears exactly once among valid samples per epoch.
* ``last_batch="drop"``: every rank runs ``floor(min range / batch)`` full steps; the remainder is
  skipped this epoch (another part of the data next epoch, as the shard order changes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from data_pipeline.augment import AugmentConfig
from data_pipeline.manifest import ShardManifest

LOADER_BACKENDS = ("dali", "torch")
LAST_BATCH_POLICIES = ("pad", "drop")


@dataclass(frozen=True)
class LoaderConfig:
    """Attributes:
    batch_size: samples per rank per step.
    backend: "dali" (GPU decode when CUDA is present, else CPU) or "torch" (webdataset +
        torchvision.transforms.v2 in DataLoader workers, the fallback and speed baseline).
    num_threads: DALI CPU threads, or DataLoader worker processes for the fallback.
    last_batch: "pad" or "drop", see the module docstring.
    shuffle_buffer: samples held for in-stream shuffling.
    seed: base seed; the shard order of epoch e is the same on every rank, augmentations differ.
    augment: the augmentation recipe.
    """

    batch_size: int = 256
    backend: str = "dali"
    num_threads: int = 4
    last_batch: str = "pad"
    shuffle_buffer: int = 1024
    seed: int = 0
    augment: AugmentConfig = field(default_factory=AugmentConfig)

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {fix}")

        need(self.batch_size >= 1, "batch_size", "use at least 1 sample per rank")
        need(self.backend in LOADER_BACKENDS, "backend", f"choose one of {LOADER_BACKENDS}")
        need(self.num_threads >= 1, "num_threads", "use at least 1")
        need(self.last_batch in LAST_BATCH_POLICIES, "last_batch", f"choose one of {LAST_BATCH_POLICIES}")
        need(self.shuffle_buffer >= 1, "shuffle_buffer", "use at least 1 (1 disables shuffling)")


@dataclass
class Batch:
    """One step of one rank: ``views`` float32 NCHW (global views first), ``instance_ids`` int64
    ``[b]``, ``valid`` bool ``[b]`` (False on padding repeats), ``labels`` int64 ``[b]`` (semantic
    labels, -1 when unknown; only from the inference loader)."""

    views: list[torch.Tensor]
    instance_ids: torch.Tensor
    valid: torch.Tensor
    labels: torch.Tensor | None = None


def rank_range(num_samples: int, rank: int, world_size: int) -> tuple[int, int]:
    """Positions ``[start, end)`` of the epoch's sample sequence that ``rank`` reads."""
    return num_samples * rank // world_size, num_samples * (rank + 1) // world_size


def steps_per_epoch(num_samples: int, world_size: int, batch_size: int, last_batch: str) -> int:
    sizes = [end - start for start, end in (rank_range(num_samples, r, world_size) for r in range(world_size))]
    steps = math.ceil(max(sizes) / batch_size) if last_batch == "pad" else min(sizes) // batch_size
    if min(sizes) == 0 or steps == 0:
        raise ValueError(
            f"{num_samples} samples over {world_size} ranks give a rank {min(sizes)} samples, not enough for one "
            f"step of data.batch_size={batch_size} with last_batch={last_batch!r}; use fewer ranks, a smaller "
            "batch, or last_batch='pad'"
        )
    return steps


def epoch_shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Shard visiting order of ``epoch``: a seeded permutation for training, stored order otherwise."""
    if not shuffle:
        return list(range(num_shards))
    return np.random.default_rng([seed, epoch]).permutation(num_shards).tolist()


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of the random augmentations and in-stream shuffle of (epoch, rank)."""
    return (seed * 1_000_003 + epoch * 10_007 + rank) % (2**31 - 1)


class FirstSightings:
    """Marks, per epoch, the first time each instance id is seen on this rank; a later sighting
    is a padding repeat.  Works whatever order the reader emits samples in."""

    def __init__(self, num_instances: int) -> None:
        self._seen = np.zeros(num_instances, dtype=bool)

    def new_epoch(self) -> None:
        self._seen[:] = False

    def mark(self, ids: np.ndarray) -> np.ndarray:
        _, first_in_batch = np.unique(ids, return_index=True)
        valid = np.zeros(ids.shape[0], dtype=bool)
        valid[first_in_batch] = True
        valid &= ~self._seen[ids]
        self._seen[ids] = True
        return valid


class EpochLoader:
    """What both loaders share: the manifest, the epoch counter, steps per epoch, and turning a
    rank's samples into a ``Batch`` with its ``valid`` marks.  Iterating runs epoch ``self.epoch``
    and moves on to the next one."""

    def __init__(
        self, shard_dir: Path, config: LoaderConfig, rank: int, world_size: int, device: torch.device, train: bool
    ) -> None:
        self.manifest = ShardManifest.load(shard_dir)
        self.shard_dir = shard_dir
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = device
        self.train = train
        self.num_instances = self.manifest.num_instances
        self.epoch = 0
        self.steps_per_epoch = steps_per_epoch(self.num_instances, world_size, config.batch_size, config.last_batch)
        self._first_sightings = FirstSightings(self.num_instances)

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def num_views(self) -> int:
        """Views per sample: every global and small crop when training, one when evaluating."""
        return len(self.config.augment.view_specs()) if self.train else 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batch(self, views: list[torch.Tensor], ids: torch.Tensor, labels: torch.Tensor | None) -> Batch:
        """``views`` must be tensors this loader owns (DALI's buffers are reused: copy first)."""
        valid = torch.from_numpy(self._first_sightings.mark(ids.numpy()))
        return Batch(
            views=[view.to(self.device) for view in views],
            instance_ids=ids.to(self.device),
            valid=valid.to(self.device),
            labels=None if labels is None else labels.to(self.device),
        )


def build_loader(shard_dir: Path, config: LoaderConfig, rank: int, world_size: int, device: torch.device, train: bool):
    """The loader chosen by ``config.backend``; iterate it once per epoch.

    ``train=True``: augmented views, shuffled.  ``train=False``: the inference pipeline (resize +
    centre crop, one view, stored order, semantic labels) for feature extraction and evaluation.
    """
    if config.backend == "dali":
        from data_pipeline.dali import DaliLoader as loader_class
    else:
        from data_pipeline.fallback import TorchLoader as loader_class
    return loader_class(Path(shard_dir), config, rank, world_size, device, train=train)
