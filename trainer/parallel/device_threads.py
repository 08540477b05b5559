"""Worker threads that run on a rank's GPU.

CUDA's current device is per thread and starts at 0.  A thread that allocates, creates events or
leaves ``torch.cuda.stream(...)`` without having set its device touches GPU 0: on a node with 8
ranks every rank then builds a CUDA context (hundreds of MB) on GPU 0, and stream restores land on
the wrong device.  So a background thread sets the rank's device once, when it starts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def use_device_in_this_thread(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def device_thread_pool(device: torch.device, name: str, workers: int = 1) -> ThreadPoolExecutor:
    """A pool whose threads have ``device`` as their current CUDA device (no-op on CPU)."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=use_device_in_this_thread,
                              initargs=(device,))
