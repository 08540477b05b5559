"""Where a training step's time goes, measured without stopping the device.

A step is cut at marks on the training thread: the views' forward through the backbone, the
objective (classifier, Sinkhorn, PIC's store), the backward, the optimizers, and the checkpoint
snapshot when one is due; the loader's wait comes from the loop.  On a GPU a mark is a CUDA event
recorded on the current stream, and the durations are read once every event of the step has
completed (``Event.query``), a step or two later: reading them never waits for the device.  On
CPU ranks a mark is the host clock, which is the device clock there.

Collective time is part of the phase that issues it (the classifier's all-gathers sit in
``objective``, DeepSpeed's gradient reduction in ``backward``); the objective's own
``comm_seconds`` metric says how much of it the classifier's collectives took.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

PHASES = ("forward", "objective", "backward", "optimizer", "checkpoint")


@dataclass
class _PendingStep:
    """One step's marks, in order: (phase that ends here, event or host time)."""

    start: object
    marks: list[tuple[str, object]] = field(default_factory=list)


class StepPhases:
    """``begin()``, then ``end(phase)`` after each phase; ``completed()`` yields the seconds of every
    phase of the steps whose marks the device has passed."""

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self._current: _PendingStep | None = None
        self._pending: deque[_PendingStep] = deque()

    def _mark(self) -> object:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        self._current = _PendingStep(self._mark())

    def end(self, phase: str) -> None:
        """The phase that started at the previous mark ends now (``begin`` or another ``end``)."""
        if self._current is not None:
            self._current.marks.append((phase, self._mark()))

    def resume(self) -> None:
        """A phase starts here; the time since the previous mark (the loop's own host work) is no phase's."""
        if self._current is not None:
            self._current.marks.append(("", self._mark()))

    def finish(self) -> None:
        """The step is over: its marks wait until the device has passed them."""
        if self._current is not None and self._current.marks:
            self._pending.append(self._current)
        self._current = None

    def _done(self, step: _PendingStep) -> bool:
        return not self.on_cuda or step.marks[-1][1].query()  # a stream's events complete in order

    def completed(self) -> list[dict[str, float]]:
        """Seconds per phase of each step the device has finished, oldest first (a phase that ran
        twice in a step, e.g. a view per forward, adds up)."""
        finished = []
        while self._pending and self._done(self._pending[0]):
            step = self._pending.popleft()
            seconds: dict[str, float] = {}
            previous = step.start
            for phase, mark in step.marks:
                elapsed = previous.elapsed_time(mark) / 1000 if self.on_cuda else mark - previous
                if phase:
                    seconds[phase] = seconds.get(phase, 0.0) + elapsed
                previous = mark
            finished.append(seconds)
        return finished
