"""Checkpoints are data, never code: every file is read with ``torch.load(weights_only=True)``.

Our own files hold tensors, numbers, strings and containers only.  DeepSpeed's ``load_checkpoint``
unpickles its files with ``weights_only=False``, which would run any code a tampered file carries,
so ``refuse_pickled_code`` opens each of them first with the safe unpickler (memory-mapped: the
tensors are not read) and lets DeepSpeed in only when all pass.  The few plain DeepSpeed classes
its optimizer states hold are allowed by name; anything else is refused, naming file and global.
"""

from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path

import torch

DEEPSPEED_SAFE_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),  # ZeRO-1/2 optimizer state (fp32)
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),  # ZeRO-3 optimizer state
    ("deepspeed.utils.tensor_fragment", "fragment_address"),  # ZeRO-1/2 parameter fragments
)


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds pickled objects that the safe unpickler refuses."""


def _safe_globals(needed: bool = False) -> list:
    """DeepSpeed's allowed classes, once DeepSpeed is loaded or when a file names one: importing
    DeepSpeed takes seconds, and a process that only reads this trainer's own files (an evaluation,
    an export, a checkpoint load outside training) never needs it."""
    import importlib

    if not needed and "deepspeed" not in sys.modules:
        return []
    return [getattr(importlib.import_module(module), name) for module, name in DEEPSPEED_SAFE_GLOBALS]


def load_data(path: Path, **kwargs):
    """``torch.load`` of a file that may hold tensors and plain data only."""
    try:
        try:
            with torch.serialization.safe_globals(_safe_globals()):
                return torch.load(path, weights_only=True, **kwargs)
        except pickle.UnpicklingError as error:
            if "deepspeed" in sys.modules or "Unsupported global: GLOBAL deepspeed." not in str(error):
                raise
        with torch.serialization.safe_globals(_safe_globals(needed=True)):  # a DeepSpeed file: once per process
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        reason = f"it references {found.group(1)}" if found else "it is not plain tensor data"
        raise UnsafeCheckpointError(
            f"{path}: refusing to load it: {reason}, and unpickling objects other than tensors and plain data "
            "could run code. Resume from a checkpoint this trainer wrote, or delete this one to fall back to the "
            "previous."
        ) from None


def refuse_pickled_code(directory: Path) -> None:
    """Open every ``*.pt`` under ``directory`` with the safe unpickler; raise on the first that fails."""
    for path in sorted(Path(directory).rglob("*.pt")):
        load_data(path, map_location="cpu", mmap=True)
