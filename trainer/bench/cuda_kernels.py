"""The CUDA kernels one training step launches, per phase, from ``torch.profiler`` (CUDA only).

The step's phase marks (``StepPhases``: begin, end of each phase, resume) become consecutive
``record_function`` ranges on the training thread.  Each kernel the profiler records on the GPU is
then given to the range in which its launch (the CUDA runtime or driver call with the kernel's
correlation id, e.g. ``cudaLaunchKernel``, ``cuLaunchKernel`` for Triton's, NCCL's
``cudaLaunchKernelExC``) started: host time on both sides, so a kernel the GPU runs late still
counts where it was asked for, and so do the backward's, launched from the autograd engine's
device thread while the training thread waits in ``backward()``.  Memory copies and memsets are
not kernels and are not counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

_LABEL = "instcls.bench.segment."
_LAUNCH_ACTIVITIES = ("cuda_runtime", "cuda_driver")
UNATTRIBUTED = "unattributed"  # a kernel whose launch the profiler did not record in a phase


def kernels_per_phase(events: Iterable, labels: dict[str, str]) -> dict[str, int]:
    """Kernels per phase among the profiler's ``events`` (``FunctionEvent``s: ``name``, ``id`` (the
    correlation id), ``activity_type``, ``time_range``); ``labels`` maps each segment range's name
    to its phase ("" for time that is no phase's, whose kernels are dropped)."""
    events = list(events)
    segments = [(event.time_range.start, event.time_range.end, labels[event.name])
                for event in events if event.name in labels]
    launched_at = {event.id: event.time_range.start for event in events
                   if getattr(event, "activity_type", None) in _LAUNCH_ACTIVITIES}
    counts: Counter[str] = Counter()
    for event in events:
        if getattr(event, "activity_type", None) != "kernel":
            continue
        launch = launched_at.get(event.id)
        phase = next((label for start, end, label in segments if launch is not None and start <= launch < end),
                     UNATTRIBUTED)
        if phase:
            counts[phase] += 1
    return dict(counts)


class PhaseKernelProfile:
    """``start()``; the phase marks as ``begin()``, ``end(phase)``, ``resume()``; ``stop()`` returns
    the kernels per phase."""

    def __init__(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        self._profile = torch.profiler.profile(activities=activities)
        self._labels: dict[str, str] = {}
        self._open: tuple[str, torch.autograd.profiler.record_function] | None = None

    def start(self) -> None:
        self._profile.start()

    def _next_segment(self, closing_phase: str) -> None:
        """Close the open range as ``closing_phase``'s and open the next one."""
        self._close(closing_phase)
        name = f"{_LABEL}{len(self._labels)}"
        self._labels[name] = ""
        segment = torch.autograd.profiler.record_function(name)
        segment.__enter__()
        self._open = (name, segment)

    def _close(self, phase: str) -> None:
        if self._open is not None:
            name, segment = self._open
            segment.__exit__(None, None, None)
            self._labels[name] = phase
            self._open = None

    def begin(self) -> None:
        self._next_segment("")

    def resume(self) -> None:
        self._next_segment("")

    def end(self, phase: str) -> None:
        self._next_segment(phase)

    def stop(self) -> dict[str, int]:
        self._close("")
        torch.cuda.synchronize()  # every kernel of the step ran, so the profiler holds its record
        self._profile.stop()
        return kernels_per_phase(self._profile.events(), self._labels)
