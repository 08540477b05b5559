"""Keep freed host memory in the process: CPU ranks reuse their large tensors without page faults.

glibc hands blocks above its mmap threshold (128 KiB, rising to at most 32 MiB as it sees frees)
back to the OS on free, and trims the heap top above a threshold, so a loop that allocates and
frees megabyte tensors (the classifier's chunk temporaries, matmul outputs, inductor's buffers)
page-faults every page of them again on each iteration.  On a CPU rank that cost 5-10% of a
classifier step.  Raising both thresholds once at start-up keeps those blocks in the heap, as
jemalloc or tcmalloc would, at the price of a resident size that does not shrink.

Training and the speed benchmarks call it; the DDP-vs-DHP memory sweep does not: it measures the
largest classifier that fits under an address-space cap, and a heap that keeps freed blocks holds
address space the classifier no longer uses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value: blocks up to 32 MiB come from the heap
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of free heap top


def keep_freed_host_memory(device: torch.device) -> bool:
    """On a CPU rank, raise glibc's mmap and trim thresholds; False (and nothing changed) on other
    devices (their tensors are not in host memory) or without glibc's mallopt."""
    if device.type != "cpu":
        return False
    done = set_glibc_malloc({M_MMAP_THRESHOLD: MMAP_THRESHOLD, M_TRIM_THRESHOLD: TRIM_THRESHOLD})
    if not done:
        log.warning("mallopt refused the allocator thresholds; CPU steps may page-fault their temporaries")
    return done


def set_glibc_malloc(options: dict[int, int]) -> bool:
    """``mallopt(parameter, value)`` for each option; False where the C library is not glibc (musl,
    macOS: their allocators behave otherwise) or glibc refused one."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all([bool(mallopt(parameter, value)) for parameter, value in options.items()])
