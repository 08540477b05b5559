"""Rank 0's progress, shaped for where its output goes.

On a terminal: tqdm's bar.  Anywhere else (a file, a pipe, a pod log) a bar is one ever-growing line
of carriage-return updates, so there are plain lines instead, at log steps (the only steps whose
loss is already on the host), at most one per ``every_s`` seconds (each epoch's end has its own
line from the trainer).
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from tqdm import tqdm


def on_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class RunPace:
    """This process's pace since its first log step, and at most one report per ``every_s`` seconds:
    what the progress lines and the TrainJob status reports share.  ``last_step`` is the run's last
    global step; the time left divides the steps left by the pace (a resumed run's restart, start-up
    and evaluations included)."""

    def __init__(self, last_step: int, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.last_step, self.every_s, self.clock = last_step, every_s, clock
        self._start: tuple[float, int] | None = None  # (time, global step) of the first log step
        self._last_report: float | None = None

    def due(self, global_step: int) -> float | None:
        """At a log step: the time now when a report is due (``every_s`` passed since the last), else None."""
        now = self.clock()
        if self._start is None:
            self._start = (now, global_step - 1)
        if self._last_report is not None and now - self._last_report < self.every_s:
            return None
        self._last_report = now
        return now

    def remaining_seconds(self, now: float, global_step: int) -> float | None:
        """The seconds left at this pace (None: no pace yet)."""
        if self._start is None:
            return None
        start_time, start_step = self._start
        if global_step <= start_step or now <= start_time:
            return None
        return (now - start_time) / (global_step - start_step) * max(self.last_step - global_step, 0)


class ProgressLines:
    """Plain progress lines: step, epoch, loss, throughput, data wait and the run's ETA (``RunPace``).

    ``total_steps`` is the run's last global step."""

    def __init__(self, total_steps: int, steps_per_epoch: int, every_s: float,
                 write: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.write = write if write is not None else (lambda line: print(line, flush=True))
        self.pace = RunPace(total_steps, every_s, clock)

    def _eta(self, now: float, global_step: int) -> str:
        remaining = self.pace.remaining_seconds(now, global_step)
        return "?" if remaining is None else _duration(remaining)

    def log_step(self, epoch: int, step_in_epoch: int, global_step: int, loss: float, images_per_s: float,
                 data_wait_share: float) -> None:
        now = self.pace.due(global_step)
        if now is None:
            return
        self.write(f"[instcls] epoch {epoch} step {step_in_epoch}/{self.steps_per_epoch} (run {global_step}/"
                   f"{self.total_steps}) | loss {loss:.4f} | {images_per_s:.1f} img/s | data wait "
                   f"{100 * data_wait_share:.0f}% | ETA {self._eta(now, global_step)}")


def epoch_bar(total: int, initial: int, epoch: int, enabled: bool, stream: TextIO | None = None) -> tqdm:
    """tqdm's bar when ``enabled`` and its stream is a terminal; a disabled (silent) one otherwise."""
    stream = stream if stream is not None else sys.stderr
    return tqdm(total=total, initial=initial, desc=f"epoch {epoch}", unit="step", file=stream,
                disable=not (enabled and on_terminal(stream)))
