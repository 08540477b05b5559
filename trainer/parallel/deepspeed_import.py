"""The one place DeepSpeed is imported: every module takes DeepSpeed, and the parts of it the trainer
uses, from here (``tests/unit/test_deepspeed_import.py`` holds that).

DeepSpeed picks its accelerator when it is first imported and, finding no GPU, warns "Setting
accelerator to CPU ..." on every CPU run.  Telling it (``DS_ACCELERATOR``, its documented switch)
what its own probe would find keeps it quiet; a value the user set is kept.  The probe runs here,
right before that first import, and not when ``trainer`` is imported: ``import trainer`` (a
notebook, a tool that only reads configs or logs) touches no device.

DeepSpeed's autotuner, which the trainer never runs, imports MLflow at DeepSpeed's import when it is
installed (it is: ``logging.mlflow``), about 1.5 s of every rank's start on 2026-12-08's 2-core machine.
MLflow is hidden from that one import; the autotuner then records that it has none, and an MLflow
imported later (the run's tracking sink) is the real one.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import torch


def name_deepspeed_accelerator(environ=os.environ) -> str:
    """Set ``DS_ACCELERATOR`` to "cuda" when CUDA devices are present, else "cpu", unless it is set;
    returns the value DeepSpeed will read."""
    if "DS_ACCELERATOR" not in environ:
        environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.device_count() > 0 and torch.cuda.is_available() else "cpu"
    return environ["DS_ACCELERATOR"]


@contextmanager
def hidden_module(name: str):
    """``import name`` raises ImportError inside the block, unless the module is loaded already."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None  # the import system's documented "not importable" marker
    try:
        yield
    finally:
        if sys.modules.get(name, 0) is None:
            del sys.modules[name]


name_deepspeed_accelerator()

# DeepSpeed reads DS_ACCELERATOR when it is imported: these imports must follow the line above.
with hidden_module("mlflow"):
    import deepspeed  # noqa: E402
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine  # noqa: E402
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine  # noqa: E402
from deepspeed.utils import (  # noqa: E402
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

__all__ = ["CheckpointEngine", "TorchCheckpointEngine", "deepspeed", "name_deepspeed_accelerator",
           "safe_get_full_fp32_param", "safe_get_full_optimizer_state", "safe_set_full_fp32_param",
           "safe_set_full_optimizer_state"]
