"""What a process asked of its shard stores: requests, bytes, opens, retries, errors, latency and
requests in flight.  One ``ReadStats`` per process (``read_stats()``), fed by every store, which
``instcls bench data`` reads; and ``ReadTally``s, each counting the reads made for one caller (a
step of a loader) on whichever threads ran them, exactly, while other steps read beside it."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

LATENCY_WINDOW = 65536  # the latest requests whose latency the percentiles are over


@dataclass(frozen=True)
class StatsSnapshot:
    requests: int
    bytes: int
    opens: int
    retries: int
    errors: int
    in_flight: int
    peak_in_flight: int
    latency_sum_s: float
    latencies_s: np.ndarray  # of the latest LATENCY_WINDOW requests

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1e3) if self.latencies_s.size else 0.0

    def since(self, earlier: "StatsSnapshot") -> "StatsSnapshot":
        """Counts between ``earlier`` and this one (latencies: those recorded since, up to the window)."""
        new = self.requests - earlier.requests
        return StatsSnapshot(new, self.bytes - earlier.bytes, self.opens - earlier.opens,
                             self.retries - earlier.retries, self.errors - earlier.errors, self.in_flight,
                             self.peak_in_flight, self.latency_sum_s - earlier.latency_sum_s,
                             self.latencies_s[-new:] if new > 0 else self.latencies_s[:0])


class ReadStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.requests = self.bytes = self.opens = self.retries = self.errors = 0
        self.in_flight = self.peak_in_flight = 0
        self.latency_sum_s = 0.0

    @contextmanager
    def request(self):
        """Time one request (a ranged read or a whole-object GET); counts its bytes through ``add_bytes``."""
        with self._lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        started = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - started
            with self._lock:
                self.in_flight -= 1
                self.requests += 1
                self.latency_sum_s += took
                self._latencies.append(took)
            tally = _current_tally()
            if tally is not None:
                tally.add_request(took)

    def add_bytes(self, count: int) -> None:
        with self._lock:
            self.bytes += count
        tally = _current_tally()
        if tally is not None:
            tally.add("bytes", count)

    def count(self, name: str) -> None:
        """One more of ``opens``, ``retries`` or ``errors``."""
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)
        tally = _current_tally()
        if tally is not None:
            tally.add(name, 1)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_in_flight = self.in_flight

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(self.requests, self.bytes, self.opens, self.retries, self.errors, self.in_flight,
                                 self.peak_in_flight, self.latency_sum_s, np.array(self._latencies))


class ReadTally:
    """The reads made for one caller, counted on every thread that runs them inside ``tallying(self)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {"bytes": 0, "opens": 0, "retries": 0, "errors": 0}
        self.latencies: list[float] = []

    def add_request(self, seconds: float) -> None:
        with self._lock:
            self.latencies.append(seconds)

    def add(self, name: str, count: int) -> None:
        with self._lock:
            self.counts[name] += count

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            latencies = np.array(self.latencies, dtype=np.float64)
            return StatsSnapshot(len(latencies), self.counts["bytes"], self.counts["opens"], self.counts["retries"],
                                 self.counts["errors"], 0, 0, float(latencies.sum()), latencies)


_local = threading.local()


def _current_tally() -> ReadTally | None:
    return getattr(_local, "tally", None)


@contextmanager
def tallying(tally: ReadTally):
    """Count this thread's store reads into ``tally`` too, until the block ends."""
    previous, _local.tally = _current_tally(), tally
    try:
        yield tally
    finally:
        _local.tally = previous


_STATS = ReadStats()


def _fresh_lock_after_fork() -> None:
    """A DataLoader worker forked while another thread held the lock would wait on it forever."""
    _STATS._lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_after_fork)


def read_stats() -> ReadStats:
    return _STATS
