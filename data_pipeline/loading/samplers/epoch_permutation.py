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

import numpy as np

from data_pipeline.loading.samplers.base import StepIndices, check_state, steps_per_epoch


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
