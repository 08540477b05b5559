"""Which samples every rank reads at each step: the one seam between "what to read" and "how".

A sampler maps ``(epoch, step)`` to the global sample indices of all ranks, plus the mask of the
ones that count (``valid``).  A global sample index is an instance id: the manifest's ids are
dense ``0..N-1``.  Loaders only ask ``sampler.step(epoch, step)`` and read what it names, so they
never need to know which sampler they hold, and any step can be produced without the ones before
it (an exact, cheap resume).  Every rank computes the whole ``[world, batch]`` table: it is tiny,
and it gives the global number of valid samples without communication.

``EpochPermutationSampler`` (the default):

* Training: epoch e reads a permutation of all N ids drawn from ``(seed, e)``, the same on every
  rank.  Step k reads the *global* batch at positions ``[k*B, (k+1)*B)`` of it, ``B = S * b`` for S
  ranks of ``b`` samples, and rank r takes positions ``k*B + r*b .. k*B + (r+1)*b``.  So the global
  batch of every step depends only on B, not on how many ranks share it: a run resharded to
  another world size with the same global batch continues with exactly the same samples.
* ``last_batch="pad"``: ``ceil(N / B)`` steps; positions past N wrap around to the start of the
  epoch's order (repeats) with ``valid=False``, so every id is valid exactly once per epoch.
* ``last_batch="drop"``: ``floor(N / B)`` full steps; the rest of the permutation is skipped this
  epoch (a different rest next epoch).
* Evaluation (``shuffle=False``): stored order ``0..N-1``, padded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from data_pipeline.config import LAST_BATCH_POLICIES


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
    raise ValueError(f"cannot continue the checkpoint's {kind} sequence ({details}); these define which samples "
                     "every step reads: resume with the same shard set and data.loader.seed, and keep the global "
                     "batch (data.loader.batch_size x ranks) and data.loader.last_batch; the number of ranks may change")


class EpochPermutationSampler:
    """A seeded permutation of all ids per epoch (or stored order), read one global batch per step."""

    KIND = "epoch_permutation"

    def __init__(self, num_samples: int, world_size: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                 last_batch: str = "pad") -> None:
        self.num_samples, self.world_size, self.batch_size = num_samples, world_size, batch_size
        self.seed, self.shuffle, self.last_batch = seed, shuffle, last_batch
        self.steps_per_epoch = steps_per_epoch(num_samples, world_size, batch_size, last_batch)
        self._order_cache: tuple[int, np.ndarray] | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All ids in the order epoch ``epoch`` reads them (the last epoch asked for is cached)."""
        cache = self._order_cache  # read once: a loader's reading threads may ask at the same time
        if cache is None or cache[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples, dtype=np.int64)
            cache = self._order_cache = (epoch, order)
        return cache[1]

    def step(self, epoch: int, step: int) -> StepIndices:
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside [0, {self.steps_per_epoch}) of this sampler's epochs")
        global_batch = self.world_size * self.batch_size
        positions = step * global_batch + np.arange(global_batch, dtype=np.int64).reshape(self.world_size, -1)
        ids = self.epoch_order(epoch)[positions % self.num_samples]
        return StepIndices(ids=ids, valid=positions < self.num_samples)

    def state_dict(self) -> dict:
        return {"kind": self.KIND, "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
                "global_batch": self.world_size * self.batch_size, "last_batch": self.last_batch}

    def load_state_dict(self, state: dict) -> None:
        expected = {key: value for key, value in self.state_dict().items() if key != "kind"}
        check_state(self.KIND, expected, state)
