"""Memory readings that mean the same thing on GPU and CPU runs.

On CUDA the allocator's own counters are exact and resettable.  On the CPU the closest equivalent
is the process's resident set size; Linux keeps its high-water mark (``VmHWM``) and lets a process
reset it by writing ``5`` to ``/proc/self/clear_refs``, so a CPU peak covers only the measured work.
"""

from __future__ import annotations

import torch


def current_rss_bytes() -> int:
    """Resident set size of this process now."""
    return status_field_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Largest resident set size since the process started or since ``reset_peak``."""
    return status_field_bytes("VmHWM")


def status_field_bytes(name: str, pid: int | str = "self") -> int:
    """A memory line of ``/proc/PID/status`` (this process by default), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/{pid}/status has no {name} line; CPU memory readings need Linux")


def reset_peak(device: torch.device) -> int:
    """Start a peak measurement; returns the baseline to pass to ``peak_since``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current RSS
    return current_rss_bytes()


def peak_since(device: torch.device, baseline: int) -> tuple[int, int]:
    """``(peak, peak - baseline)`` in bytes: CUDA max allocated, or the CPU process's peak RSS."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = peak_rss_bytes()
    return peak, peak - baseline
