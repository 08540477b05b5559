"""One self-test check's outcome, and the table they are printed as."""

from __future__ import annotations

from dataclasses import dataclass

PASS, FAIL, SKIPPED = "pass", "FAIL", "skipped"


@dataclass(frozen=True)
class CheckResult:
    """``figure``: what was measured (an error, a time, bytes); ``detail``: why it failed or was skipped."""

    name: str
    status: str
    figure: str = ""
    detail: str = ""
    at: float = 0.0  # time.time() when it ended: which rank failed first


def format_table(results: list[CheckResult]) -> str:
    rows = [("check", "result", "figure", "detail")] + [(r.name, r.status, r.figure, r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3] for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)
