"""`instcls drill`: every fault drill on CPU ranks, one table (see ``trainer.drills.catalogue``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.drills.catalogue import DrillResult


def run_drills(names: list[str], work_dir: Path, progress=print) -> list[DrillResult]:
    # The drills load torch: imported here, so that `instcls drill --help` (trainer.drills.drill_names) does not.
    from trainer.drills.catalogue import DRILLS, DrillContext

    context = DrillContext(work_dir)
    results = []
    for name in names:
        started = time.time()
        progress(f"drill {name} ...")
        results.append(DRILLS[name](context))
        progress(f"drill {name}: {'passed' if results[-1].passed else 'FAILED'} ({time.time() - started:.0f} s)")
    return results


def format_table(results: list[DrillResult]) -> str:
    """A Markdown table: fault, what happened, data lost, time to recover, verdict."""
    lines = ["| drill | fault | what happened | data lost | recovered in | verdict |", "|---|---|---|---|---|---|"]
    for r in results:
        recovery = f"{r.recovery_s:.1f} s" if r.recovery_s is not None else "-"
        lines.append(f"| {r.name} | {r.fault} | {r.outcome} | {r.data_lost} | {recovery} | "
                     f"{'passed' if r.passed else '**FAILED**'} |")
    return "\n".join(lines)
