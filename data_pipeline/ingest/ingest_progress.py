"""Progress and ETA of a long ingest: a tqdm bar on a terminal, a plain line now and then
otherwise (a pod's log, a CI job), so a 14M-image run says how far it is without flooding a log."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

LINE_INTERVAL_S = 30.0


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class IngestProgress:
    """``advance(amount)`` per finished shard; ``amount`` in ``unit`` (images, bytes...), of
    ``total`` in all, ``already`` of which were done before this run (not counted in the rate)."""

    def __init__(self, what: str, total: int, already: int, unit: str, enabled: bool,
                 interval_s: float = LINE_INTERVAL_S) -> None:
        self.what, self.total, self.unit, self.interval_s = what, total, unit, interval_s
        self.done, self.started_with = already, already
        self.enabled = enabled
        self.start = self.last_line = time.monotonic()
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=already, desc=what, unit=unit, unit_scale=True, dynamic_ncols=True)

    def advance(self, amount: int) -> None:
        self.done += amount
        if self.bar is not None:
            self.bar.update(amount)
            return
        now = time.monotonic()
        if self.enabled and (now - self.last_line >= self.interval_s or self.done >= self.total):
            self.last_line = now
            print(self.line(now), file=sys.stderr, flush=True)

    def line(self, now: float) -> str:
        rate = (self.done - self.started_with) / max(now - self.start, 1e-9)
        eta = _duration((self.total - self.done) / rate) if rate > 0 else "?"
        share = 100.0 * self.done / max(self.total, 1)
        return (f"{self.what}: {self.done}/{self.total} {self.unit} ({share:.1f}%), {rate:.1f} {self.unit}/s, "
                f"elapsed {_duration(now - self.start)}, ETA {eta}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
