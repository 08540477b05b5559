"""A per-rank memory cap that turns "too big" into a clean allocation failure.

GPU: ``torch.cuda.set_per_process_memory_fraction`` makes the caching allocator raise
``torch.OutOfMemoryError`` past the cap.  CPU: ``RLIMIT_AS`` (address space) set to the process's
current size plus the cap, so ``malloc`` fails and torch raises "can't allocate memory" instead of
the kernel's OOM killer taking the machine down; the capped process computes on one thread.  Set it
after imports and process-group setup, so the cap measures what the measured work allocates.
"""

from __future__ import annotations

import resource

import torch

from trainer.observability.memory import status_field_bytes
from trainer.parallel.host_memory import M_ARENA_MAX, M_MMAP_THRESHOLD, set_glibc_malloc


def apply_memory_cap(device: torch.device, cap_bytes: int) -> None:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        already = torch.cuda.memory_allocated(device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (already + cap_bytes) / total), device)
        return
    _make_the_cap_count_live_tensors()
    # Each OpenMP thread's stack (8 MiB) is address space too: with one thread per core a many-core
    # machine would spend the cap on stacks.  One intra-op thread makes the cap the same everywhere.
    torch.set_num_threads(1)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = status_field_bytes("VmSize") + cap_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


# Below this size glibc serves blocks from its heaps, above it each block is its own mapping.
CAPPED_MMAP_THRESHOLD = 128 << 10  # glibc's initial value, pinned


def _make_the_cap_count_live_tensors() -> None:
    """Under an address-space cap, what counts must be the tensors alive at once, not how glibc
    places them.  Two of its habits would make the limit depend on the machine and its load:
    - A thread that first allocates under contention may get a fresh arena, which reserves 64 MiB
      of address space at once.  One arena from here on (threads share the existing ones).
    - glibc raises its mmap threshold (up to 32 MiB) as it sees large blocks freed, so a
      classifier's multi-megabyte tensors may come from the heap, where a hole left by a freed one
      stays mapped and a later block grows the heap past it (measured: +48 MiB on one rank of two
      in some runs, not others).  A pinned threshold turns that adjustment off: each block of
      128 KiB or more is mapped on allocation and unmapped on free.
    Harmless (nothing done) where the C library is not glibc."""
    set_glibc_malloc({M_ARENA_MAX: 1, M_MMAP_THRESHOLD: CAPPED_MMAP_THRESHOLD})


def is_out_of_memory(error: BaseException) -> bool:
    """True for an allocation failure under the cap (CUDA or CPU), False for anything else."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error)
    return "can't allocate memory" in text or "out of memory" in text.lower() or "Cannot allocate memory" in text
