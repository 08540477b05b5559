"""Each rank's random number generators (python, numpy, torch, CUDA) in a checkpoint.

With the world size unchanged a resumed run continues every rank's streams exactly; with another,
ranks no longer match the saved ones, so each is reseeded for (seed, step, rank) instead.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from trainer.checkpoint.checkpoint_files import rank_file, read_trainer_meta
from trainer.checkpoint.safe_load import load_data
from trainer.checkpoint.save_plan import FileWrite, SavePlan
from trainer.parallel import ParallelDims

RNG_FOLDER = "rng"


def reseed(seed: int, step: int, rank: int) -> None:
    """Deterministic RNG state for (seed, step, rank)."""
    mixed = (seed * 1_000_003 + step * 997 + rank) % (2**31)
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)


def rng_states() -> dict:
    """This process's RNG states as tensors and plain numbers, so loading them runs no pickled code."""
    version, python_state, gauss = random.getstate()
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    states = {
        "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    """Put back what ``rng_states`` returned."""
    python, numpy_state = states["python"], states["numpy"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["position"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class RngState:
    """The checkpoint entry (a ``DirectoryState``) of this rank's RNG states: ``rng/rank-XXXXX.pt``.

    Reseeding needs the run's ``seed`` and the step it resumes at, read from ``position.global_step``
    when loading; ``position`` must be restored before this entry (the trainer's position entry
    comes first in the checkpoint mapping, and updates the same object)."""

    def __init__(self, seed: int, position) -> None:
        self.seed, self.position = seed, position

    def snapshot(self, path: Path, dims: ParallelDims, step: int) -> SavePlan:
        return [FileWrite(f"{RNG_FOLDER}/{rank_file(dims.rank)}", rng_states(), owned=True)]  # fresh copies

    def load_from(self, path: Path, dims: ParallelDims) -> None:
        """This rank's RNG states when the world size is unchanged, else a fresh seed for (step, rank)."""
        rng_file = Path(path) / RNG_FOLDER / rank_file(dims.rank)
        if read_trainer_meta(path)["world_size"] == dims.world_size and rng_file.is_file():
            set_rng_states(load_data(rng_file))
        else:
            reseed(self.seed, self.position.global_step, dims.rank)
