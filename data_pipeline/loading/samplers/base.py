"""What every sampler is: the ``Sampler`` protocol, the ``StepIndices`` it hands out, and the
helpers samplers share (epoch length, checkpoint-state checks).  See ``epoch_permutation`` for
the default sampler and the registry in this package's ``__init__`` for adding one."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

LAST_BATCH_POLICIES = ("pad", "drop")


@dataclass(frozen=True)
class StepIndices:
    """One step on every rank: ``ids`` int64 ``[world, batch]``, ``valid`` bool ``[world, batch]``."""

    ids: np.ndarray
    valid: np.ndarray

    @property
    def global_valid(self) -> int:
        return int(self.valid.sum())


class Sampler(Protocol):
    """What a loader needs from a sampler (``world_size`` and ``batch_size`` are checked against
    the loader's own when it is built)."""

    steps_per_epoch: int
    world_size: int
    batch_size: int

    def step(self, epoch: int, step: int) -> StepIndices: ...

    def state_dict(self) -> dict:
        """What identifies the sequence of steps, for a checkpoint."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Raise ``ValueError`` naming the fields if a checkpoint's sequence cannot be continued
        (what the samples of every step are must not change; the number of ranks may)."""
        ...


def steps_per_epoch(num_samples: int, world_size: int, batch_size: int, last_batch: str) -> int:
    """Steps of one epoch under ``last_batch`` (see the module docstring)."""
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"last_batch={last_batch!r} is invalid: choose one of {LAST_BATCH_POLICIES}")
    global_batch = world_size * batch_size
    steps = math.ceil(num_samples / global_batch) if last_batch == "pad" else num_samples // global_batch
    if steps == 0:
        raise ValueError(
            f"{num_samples} samples are not enough for one step of {world_size} ranks x data.batch_size={batch_size} "
            f"with last_batch={last_batch!r}; use fewer ranks, a smaller batch, or last_batch='pad'"
        )
    return steps


def check_state(kind: str, expected: dict, found: dict) -> None:
    """Compare a checkpoint's sampler state with this run's; raise naming every differing field."""
    if found.get("kind") != kind:
        raise ValueError(f"the checkpoint's sampler is {found.get('kind')!r}, this run uses {kind!r}; "
                         "resume with the same sampler or start a new run")
    differing = [key for key, value in expected.items() if found.get(key) != value]
    if not differing:
        return
    details = "; ".join(f"{key}: checkpoint {found.get(key)!r}, now {expected[key]!r}" for key in differing)
    raise ValueError(
        f"cannot continue the checkpoint's {kind} sequence ({details}); these define which samples "
        "every step reads: resume with the same shard set and data.loader.seed, and keep the global "
        "batch (data.loader.batch_size x ranks) and data.loader.last_batch; the number of ranks may change"
    )
