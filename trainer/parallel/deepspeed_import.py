"""The one place DeepSpeed is imported: every module takes DeepSpeed, and the parts of it the trainer
uses, from here (``tests/unit/test_deepspeed_import.py`` holds that).

DeepSpeed picks its accelerator when it is first imported and, finding no GPU, warns "Setting
accelerator to CPU ..." on every CPU run.  Telling it (``DS_ACCELERATOR``, its documented switch)
what its own probe would find keeps it quiet; a value the user set is kept.  The probe runs here,
right before that first import, and not when ``trainer`` is imported: ``import trainer`` (a
notebook, a tool that only reads configs or logs) touches no device.
"""

from __future__ import annotations

import os

import torch


def name_deepspeed_accelerator(environ=os.environ) -> str:
    """Set ``DS_ACCELERATOR`` to "cuda" when CUDA devices are present, else "cpu", unless it is set;
    returns the value DeepSpeed will read."""
    if "DS_ACCELERATOR" not in environ:
        environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.device_count() > 0 and torch.cuda.is_available() else "cpu"
    return environ["DS_ACCELERATOR"]


name_deepspeed_accelerator()

# DeepSpeed reads DS_ACCELERATOR when it is imported: these imports must follow the line above.
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
