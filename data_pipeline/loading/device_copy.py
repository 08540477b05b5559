"""Host -> device copies that let the CPU run ahead of the GPU.

A copy from pageable host memory to a CUDA device is synchronous whatever ``non_blocking`` says:
the driver stages it through its own pinned buffer and the CPU waits for the transfer, so the
Python loop can never queue the next kernels while the GPU works.  Copying into page-locked
(pinned) memory first, a host memcpy of a few hundred bytes for a step's ids, makes the transfer
truly asynchronous.  PyTorch's caching host allocator keeps a pinned block alive until the copy
that reads it has finished, so the source may be dropped at once.

On CPU (and for tensors already on the device) nothing is copied or pinned: ``.to`` returns the
tensor itself, as before.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``data`` (a host array or tensor) on ``device``; asynchronous from pinned memory on CUDA."""
    tensor = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
