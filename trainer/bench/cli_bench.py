"""`instcls bench cli`: how long `instcls --help` takes, beside `python -c "import torch"`.

Building the command line imports no torch (each command's handler imports what it needs), so its
help answers before torch would have loaded; this measures both, and the bare interpreter's start
for scale.  Each run is a fresh process, so nothing is cached in it; the commands take turns
within a repeat, so a busy moment of a shared machine falls on all of them; the median of the
repeats is reported.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainer.bench.settings.cli import CliBenchSettings


def commands() -> dict[str, list[str]]:
    """What is timed, by the name the report prints: the installed ``instcls`` script beside this
    interpreter (``python -m trainer.cli`` where it is not installed), torch's import, no work."""
    script = Path(sys.executable).with_name("instcls")
    instcls = [str(script)] if script.is_file() else [sys.executable, "-m", "trainer.cli"]
    return {
        "instcls --help": [*instcls, "--help"],
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "python -c pass": [sys.executable, "-c", "pass"],
    }


def _seconds(command: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"bench cli: {' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    return seconds


def run(settings: CliBenchSettings) -> dict:
    timed = commands()
    for _ in range(settings.warmup):
        for command in timed.values():
            _seconds(command)
    runs: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(settings.repeats):
        for name, command in timed.items():
            runs[name].append(_seconds(command))
    median = {name: statistics.median(seconds) for name, seconds in runs.items()}
    return dict(settings=dict(repeats=settings.repeats, warmup=settings.warmup),
                commands={name: " ".join(command) for name, command in timed.items()}, runs_s=runs, median_s=median,
                torch_over_help=median['python -c "import torch"'] / median["instcls --help"])


def format_report(summary: dict) -> str:
    s = summary["settings"]
    lines = [f"each command in a fresh process: median of {s['repeats']} runs after {s['warmup']} warm-up "
             "(the commands take turns)",
             f"{'command':<28}{'median s':>10}  runs s"]
    for name, seconds in summary["runs_s"].items():
        lines.append(f"{name:<28}{summary['median_s'][name]:>10.3f}  " + " ".join(f"{run:.3f}" for run in seconds))
    lines.append(f"`import torch` alone takes {summary['torch_over_help']:.1f}x as long as `instcls --help`")
    return "\n".join(lines)
