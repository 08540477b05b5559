"""What a process asked of its shard stores: requests, bytes, opens, retries, errors, latency and
requests in flight.  One ``ReadStats`` per process (``read_stats()``), fed by every store; the
Prometheus exporter and ``instcls bench data`` read it."""

from __future__ import annotations

import itertools
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

    def add_bytes(self, count: int) -> None:
        with self._lock:
            self.bytes += count

    def count(self, name: str) -> None:
        """One more of ``opens``, ``retries`` or ``errors``."""
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_in_flight = self.in_flight

    def mark(self) -> tuple[int, int, int, int, int, float]:
        """The counters now, for ``since``: cheaper than a snapshot (no latency copy)."""
        with self._lock:
            return self.requests, self.bytes, self.opens, self.retries, self.errors, self.latency_sum_s

    def since(self, mark: tuple[int, int, int, int, int, float]) -> StatsSnapshot:
        """What this process asked of its stores since ``mark`` (with the latencies of those requests,
        up to the window).  Exact where one reader at a time reads, as each loader process does."""
        with self._lock:
            requests, size, opens, retries, errors, latency_sum = mark
            new = self.requests - requests
            latest = list(itertools.islice(reversed(self._latencies), new)) if new > 0 else []
            latencies = np.array(latest[::-1], dtype=np.float64)
            return StatsSnapshot(new, self.bytes - size, self.opens - opens, self.retries - retries,
                                 self.errors - errors, self.in_flight, self.peak_in_flight,
                                 self.latency_sum_s - latency_sum, latencies)

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(self.requests, self.bytes, self.opens, self.retries, self.errors, self.in_flight,
                                 self.peak_in_flight, self.latency_sum_s, np.array(self._latencies))


_STATS = ReadStats()


def read_stats() -> ReadStats:
    return _STATS
