"""Figures read back from a job's JSON-lines logs (``logging.dir/rank-NNNNN.jsonl``): step times,
RSS at log steps, the objective's start-up pass, checkpoint saves and the resume.

Everything is parsed from what the trainer writes anyway, so the rehearsal measures the job as it
runs, not an instrumented copy of it.  The save messages are the ones the trainer prints
(``trainer.checkpoint.async_checkpoint``)."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from trainer.observability.report import RunLogs

BACKGROUND_SAVE = re.compile(r"saved (\S+) in ([\d.]+) s in the background; the step waited ([\d.]+) s")
BLOCKING_SAVE = re.compile(r"saved (\S+) in ([\d.]+) s \(the run waited for it\)")
OBJECTIVE_READY = re.compile(r"objective \S+ ready in ([\d.]+)s")


@dataclass(frozen=True)
class Save:
    path: str
    seconds: float  # from the start of the save to its commit
    stall_s: float | None  # what the step waited for (None: a blocking save, the step waited for all of it)


def _messages(logs: RunLogs, rank: int) -> list[dict]:
    return logs.events("message", rank)


def saves(logs: RunLogs, rank: int) -> list[Save]:
    found = []
    for record in _messages(logs, rank):
        if match := BACKGROUND_SAVE.search(record["message"]):
            found.append(Save(match[1], float(match[2]), float(match[3])))
        elif match := BLOCKING_SAVE.search(record["message"]):
            found.append(Save(match[1], float(match[2]), None))
    return found


def objective_ready_s(logs: RunLogs, rank: int = 0) -> float | None:
    """The objective's start-up (the contrastive prior's pass over all N images, when on)."""
    for record in _messages(logs, rank):
        if match := OBJECTIVE_READY.search(record["message"]):
            return float(match[1])
    return None


def step_seconds(logs: RunLogs, skip_windows: int = 1, rank: int = 0) -> dict:
    """Seconds per step between log steps: the median window (a save's stall or another job's
    burst moves it little) and the mean over the run, both without the first ``skip_windows``
    windows (the first step's set-up and warm-up)."""
    steps = logs.events("step", rank)
    if len(steps) < 2:
        return {}
    first = steps[min(skip_windows, len(steps) - 2)]  # where the kept windows start
    kept = steps[steps.index(first):]
    per_step = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(kept, kept[1:])]
    span = kept[-1]["time"] - first["time"]
    # A log step's data_wait_s is the wait of the window that ends there.
    data_wait = sum(s["data_wait_s"] for s in kept[1:])
    return {"median_s": statistics.median(per_step), "mean_s": span / (kept[-1]["step"] - first["step"]),
            "slowest_window_s": max(per_step), "from_step": first["step"], "to_step": kept[-1]["step"],
            "data_wait_share": data_wait / span}


def rss_at_log_steps(logs: RunLogs, first_step: int = 1, last_step: int | None = None) -> dict[int, int]:
    """The largest RSS a rank reported at its log steps from ``first_step`` to ``last_step``, by
    rank (the steady state of training, e.g. before and after the first asynchronous save)."""
    found = {}
    for rank in sorted(logs.by_rank):
        values = [s["memory_bytes"]["rss"] for s in logs.events("step", rank)
                  if first_step <= s["step"] and (last_step is None or s["step"] <= last_step)]
        if values:
            found[rank] = max(values)
    return found


def resume_timeline(logs: RunLogs, launched: float, rank: int = 0) -> dict:
    """Seconds from the launch command to each milestone of a resumed job: the ranks up (the
    ``start`` record, after imports and the rendezvous), the checkpoint loaded (``resumed from``)
    and the first step done."""
    start = logs.events("start", rank)[0]["time"]
    resumed = next((r["time"] for r in _messages(logs, rank) if r["message"].startswith("resumed from")), None)
    first_step = logs.events("step", rank)[0]
    return {"ranks_up_s": start - launched, "checkpoint_loaded_s": None if resumed is None else resumed - launched,
            "first_step_s": first_step["time"] - launched, "first_step": first_step["step"],
            "load_s": None if resumed is None else resumed - start}


def moment(logs: RunLogs, when: float | None, rank: int = 0) -> str:
    """Where in the run ``when`` (epoch seconds) fell, in the terms of its log: the objective's
    start-up pass, between two log steps, or after the last one (the final save)."""
    if when is None:
        return "-"
    messages = _messages(logs, rank)
    resumed = next((r["time"] for r in messages if r["message"].startswith("resumed from")), None)
    ready = next((r["time"] for r in messages if OBJECTIVE_READY.search(r["message"])), None)
    if resumed is not None and when <= resumed:
        return "start-up (loading the checkpoint)"
    if ready is not None and when <= ready:
        return "start-up (the objective's pass: the contrastive prior)"
    steps = logs.events("step", rank)
    before = [s["step"] for s in steps if s["time"] <= when]
    after = [s["step"] for s in steps if s["time"] > when]
    if not before:  # a step's record is written when it ends
        return f"start-up or step {after[0]}" if after else "-"
    if not after:
        return f"after step {before[-1]} (the last save)"
    return f"steps {before[-1]}-{after[0]}"


def read(directory: Path) -> RunLogs:
    return RunLogs.read(directory)
