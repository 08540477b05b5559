"""A fixed subset of the bank's samples (``eval.bank_samples``), for banks too large to score whole.

The subset is the ``bank_samples`` ids with the smallest keyed hash ``splitmix64(id + seed * φ)``:
a pure function of (id, seed), so it is the same on every rank, every run and every machine, does
not depend on numpy's random streams (which may change between versions), and a larger
``bank_samples`` keeps every sample of a smaller one.  Only the subset is read and extracted.
"""

from __future__ import annotations

import numpy as np

from data_pipeline.contract import EpochPermutationSampler, StepIndices

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment, also used to spread the seed


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's output function (a bijection of uint64 with good avalanche), vectorised."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps modulo 2**64 by design
        z = values + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def keyed_unit(ids: np.ndarray, seed: int, stream: int, index: int = 0) -> np.ndarray:
    """A number in [0, 1) per id, a pure function of (id, seed, stream, index): the linear probe's
    held-out split, mini-batches (``index``: the epoch) and label fractions, the same on every rank
    however the ids are spread over the ranks.  Two rounds of splitmix64, 53 bits kept."""
    salt = np.uint64((stream << 32) + index)
    with np.errstate(over="ignore"):
        keys = _splitmix64(np.asarray(ids).astype(np.uint64) + np.uint64(seed) * _GOLDEN)
        keys = _splitmix64(keys ^ (salt * _GOLDEN))
    return (keys >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def bank_subset_ids(num_samples: int, bank_samples: int, seed: int) -> np.ndarray:
    """The ascending ids of ``min(bank_samples, num_samples)`` of ``0..num_samples-1``, fixed by ``seed``."""
    if bank_samples >= num_samples:
        return np.arange(num_samples, dtype=np.int64)
    ids = np.arange(num_samples, dtype=np.uint64)
    with np.errstate(over="ignore"):
        keys = _splitmix64(ids + np.uint64(seed) * _GOLDEN)
    chosen = np.argpartition(keys, bank_samples - 1)[:bank_samples]  # hash collisions: none, it is a bijection
    return np.sort(chosen).astype(np.int64)


class SubsetSampler:
    """Reads only ``ids`` (ascending), in that order, padded like evaluation's stored-order sampler:
    rank r of step s takes positions ``s*B + r*b ..``, repeats past the end marked not valid."""

    KIND = "fixed_subset"

    def __init__(self, ids: np.ndarray, world_size: int, batch_size: int) -> None:
        self.ids = np.asarray(ids, dtype=np.int64)
        self._positions = EpochPermutationSampler(len(self.ids), world_size, batch_size, shuffle=False,
                                                  last_batch="pad")
        self.world_size, self.batch_size = world_size, batch_size
        self.steps_per_epoch = self._positions.steps_per_epoch

    def step(self, epoch: int, step: int) -> StepIndices:
        positions = self._positions.step(epoch, step)
        return StepIndices(ids=self.ids[positions.ids], valid=positions.valid)

    def state_dict(self) -> dict:
        return {"kind": self.KIND, "num_samples": len(self.ids)}

    def load_state_dict(self, state: dict) -> None:
        raise ValueError("the bank subset sampler belongs to evaluation, which is never resumed from a checkpoint")
