"""Running the rehearsal's commands: timed, their output kept in a file, and the peak resident
memory of every rank they start.

Peak RSS is read from the ranks themselves (``VmHWM`` in ``/proc/PID/status``, the kernel's
high-water mark since the process started), polled while they run, so that a rank that crashes
still has one (a clean end, ``max_steps`` included, also logs it in its summary record).  The mark
only grows, so the last reading is the peak up to one poll before the rank exited.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from trainer.observability.memory import status_field_bytes
from trainer.rehearsal.settings import REPO

INSTCLS = [sys.executable, "-m", "trainer.cli"]
POLL_S = 0.5
GROWTH_STEP = 16 * 2**20


class StageFailed(RuntimeError):
    """A command of the rehearsal failed; the message ends with the tail of what it printed."""


def rehearsal_env() -> dict[str, str]:
    """One thread per process (2 cores shared by the ranks, the loaders and the other jobs), and
    this checkout on the path, not an installed copy."""
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def output_tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def fail(what: str, output: Path, code: int | None) -> StageFailed:
    return StageFailed(f"{what} failed (exit code {code}); the end of {output}:\n{output_tail(output)}")


@dataclass
class Finished:
    """A command that ran: when it started (epoch seconds, comparable with the JSON logs' ``time``)
    and how long it took."""

    started: float
    seconds: float
    output: Path


def start(command: list[str], output: Path, cwd: Path = REPO) -> subprocess.Popen:
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w") as sink:
        return subprocess.Popen(command, cwd=cwd, env=rehearsal_env(), stdout=sink, stderr=subprocess.STDOUT)


def run(command: list[str], output: Path, what: str, timeout_s: float = 3 * 3600,
        watch: RankMemoryWatch | None = None) -> Finished:
    """Run ``command`` to the end (``watch``: follow the memory of the ranks it starts)."""
    started, clock = time.time(), time.perf_counter()
    process = start(command, output)
    if watch is not None:
        watch.follow(process.pid)
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        raise fail(f"{what} (over {timeout_s:.0f} s)", output, None) from None
    if code != 0:
        raise fail(what, output, code)
    return Finished(started, time.perf_counter() - clock, output)


def _peak_rss(pid: int) -> int | None:
    try:
        return status_field_bytes("VmHWM", pid)
    except (OSError, RuntimeError):  # exited between the listing and the read (a zombie has no Vm lines)
        return None


@dataclass
class RankMemoryWatch:
    """Polls the peak RSS of every rank below the followed processes (torchrun's workers, told
    apart from the agents by the ``RANK`` and ``LOCAL_WORLD_SIZE`` torchrun gives them)."""

    roots: list[int] = field(default_factory=list)
    peak_by_rank: dict[int, int] = field(default_factory=dict)
    # (epoch seconds, peak) each time a rank's peak rose by GROWTH_STEP or more: when, against the
    # JSON logs' times, the memory was taken
    growth_by_rank: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def follow(self, pid: int) -> None:
        self.roots.append(pid)

    def __enter__(self) -> RankMemoryWatch:
        self._thread = threading.Thread(target=self._poll, name="rehearsal-rss-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak_reached(self, rank: int, within: int = 2 * GROWTH_STEP) -> float | None:
        """When ``rank``'s peak was (within ``within`` bytes) reached, in epoch seconds."""
        growth, peak = self.growth_by_rank.get(rank, []), self.peak_by_rank.get(rank)
        return next((when for when, value in growth if value >= peak - within), None)

    def _ranks(self) -> dict[int, int]:
        """``{pid: rank}`` of the ranks running now."""
        found = {}
        for root in list(self.roots):
            try:
                processes = psutil.Process(root).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for process in processes:
                try:
                    env = process.environ()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if "RANK" in env and "LOCAL_WORLD_SIZE" in env:
                    found[process.pid] = int(env["RANK"])
        return found

    def _poll(self) -> None:
        while not self._stop.is_set():
            for pid, rank in self._ranks().items():
                peak = _peak_rss(pid)
                if peak is None:
                    continue
                self.peak_by_rank[rank] = max(peak, self.peak_by_rank.get(rank, 0))
                growth = self.growth_by_rank.setdefault(rank, [])
                if not growth or peak >= growth[-1][1] + GROWTH_STEP:
                    growth.append((time.time(), peak))
            self._stop.wait(POLL_S)
