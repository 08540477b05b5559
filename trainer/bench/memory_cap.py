"""A per-rank memory cap that turns "too big" into a clean allocation failure.

GPU: ``torch.cuda.set_per_process_memory_fraction`` makes the caching allocator raise
``torch.OutOfMemoryError`` past the cap.  CPU: ``RLIMIT_AS`` (address space) set to the process's
current size plus the cap, so ``malloc`` fails and torch raises "can't allocate memory" instead of
the kernel's OOM killer taking the machine down.  Set it after imports and process-group setup,
so the cap measures what the measured work allocates.
"""

from __future__ import annotations

import ctypes
import resource

import torch

from trainer.observability.memory import status_field_bytes


def apply_memory_cap(device: torch.device, cap_bytes: int) -> None:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        already = torch.cuda.memory_allocated(device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (already + cap_bytes) / total), device)
        return
    _stop_new_malloc_arenas()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = status_field_bytes("VmSize") + cap_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


_M_ARENA_MAX = -8  # glibc's mallopt parameter number


def _stop_new_malloc_arenas() -> None:
    """A thread that first allocates under contention may get a fresh glibc arena, which reserves
    64 MiB of address space at once: under an address-space cap that is a false "out of memory"
    that depends on the machine's core count and timing.  Limit glibc to one arena from here on
    (threads then share the existing ones); harmless where the C library is not glibc."""
    try:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass


def is_out_of_memory(error: BaseException) -> bool:
    """True for an allocation failure under the cap (CUDA or CPU), False for anything else."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error)
    return "can't allocate memory" in text or "out of memory" in text.lower() or "Cannot allocate memory" in text
