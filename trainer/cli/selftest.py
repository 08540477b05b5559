"""`instcls selftest`: the checks to pass on a new GPU node or cluster before a long job."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(commands) -> None:
    parser = commands.add_parser(
        "selftest", help="check every GPU path on this node's devices (the CPU subset without a GPU)",
        description="Runs NCCL collectives across all visible GPUs, DALI's mixed decode, PIC's pinned host store "
        "with its side-stream prefetch, the compiled CO2 kernel, one step of the shipped ImageNet-1K job "
        "(configs/in1k_r50_64gpu.yaml: its DeepSpeed config, ResNet-50 and batch) with the sharded classifier, its "
        "memory against instcls plan, and a count of host syncs per step, then prints pass/fail with figures.  "
        "Without a GPU it runs the CPU subset (gloo, DALI's CPU decoder, inductor's C++) and says what it skipped.  "
        "Exits 1 on a failure.")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--only", action="append", metavar="CHECK",
                        help="run only this check, named as its row is (e.g. 'collectives'; repeatable): to look at "
                        "one path again without waiting for the others")
    parser.set_defaults(handler=_run_selftest)


def _run_selftest(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from trainer.selftest import format_table, run_selftest
    from trainer.selftest.report import FAIL

    results = run_selftest(progress=lambda line: print(line, flush=True), only=args.only)
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(result) for result in results], indent=2))
    return 1 if any(result.status == FAIL for result in results) else 0
