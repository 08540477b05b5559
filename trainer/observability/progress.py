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


class ProgressLines:
    """Plain progress lines: step, epoch, loss, throughput, data wait and the run's ETA.

    ``total_steps`` is the run's last global step; the ETA divides the steps left by this process's
    pace since its first line (a resumed run's restart, start-up and evaluations included)."""

    def __init__(self, total_steps: int, steps_per_epoch: int, every_s: float,
                 write: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_steps, self.steps_per_epoch, self.every_s = total_steps, steps_per_epoch, every_s
        self.write = write if write is not None else (lambda line: print(line, flush=True))
        self.clock = clock
        self._start: tuple[float, int] | None = None  # (time, global step) of the first report
        self._last_line: float | None = None

    def _eta(self, now: float, global_step: int) -> str:
        start_time, start_step = self._start
        if global_step <= start_step or now <= start_time:
            return "?"
        pace = (now - start_time) / (global_step - start_step)
        return _duration(pace * max(self.total_steps - global_step, 0))

    def log_step(self, epoch: int, step_in_epoch: int, global_step: int, loss: float, images_per_s: float,
                 data_wait_share: float) -> None:
        now = self.clock()
        if self._start is None:
            self._start = (now, global_step - 1)
        if self._last_line is not None and now - self._last_line < self.every_s:
            return
        self._last_line = now
        self.write(f"[instcls] epoch {epoch} step {step_in_epoch}/{self.steps_per_epoch} (run {global_step}/"
                   f"{self.total_steps}) | loss {loss:.4f} | {images_per_s:.1f} img/s | data wait "
                   f"{100 * data_wait_share:.0f}% | ETA {self._eta(now, global_step)}")


def epoch_bar(total: int, initial: int, epoch: int, enabled: bool, stream: TextIO | None = None) -> tqdm:
    """tqdm's bar when ``enabled`` and its stream is a terminal; a disabled (silent) one otherwise."""
    stream = stream if stream is not None else sys.stderr
    return tqdm(total=total, initial=initial, desc=f"epoch {epoch}", unit="step", file=stream,
                disable=not (enabled and on_terminal(stream)))
