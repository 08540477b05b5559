"""`instcls drill`: the fault drills on 2-rank CPU jobs, one table of what survived."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(commands) -> None:
    from trainer.drills.drill_names import drill_names

    names = drill_names()
    parser = commands.add_parser(
        "drill", help="break real 2-rank CPU jobs the way a cluster does and print what survived",
        description="Runs each fault drill (SIGKILL mid-step and mid-save, a damaged checkpoint, a full disk, "
        "SIGTERM, NaN, taken ports, pickled code, a damaged shard, and OVERLAY/DRILL: each multi-node overlay's own "
        "pods replaced, preempted, deleted, lost for good) on the embedded digits and prints a table: fault, what "
        "happened, data lost, time to recover.  Exits 1 if any drill failed.")
    parser.add_argument("--only", type=lambda text: text.split(","), default=list(names),
                        help=f"comma-separated drills (default: all of {', '.join(names)})")
    parser.add_argument("--work-dir", type=Path, default=Path("out/drills"), help="where the drills' jobs run")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.set_defaults(handler=_run_drill)


def _run_drill(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from trainer.drills import format_table, run_drills
    from trainer.drills.catalogue import DRILLS

    unknown = [name for name in args.only if name not in DRILLS]
    if unknown:
        raise ValueError(f"drill --only: unknown drills {unknown}; choose from {', '.join(DRILLS)}")
    results = run_drills(args.only, args.work_dir, progress=lambda line: print(line, flush=True))
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.passed for r in results) else 1
