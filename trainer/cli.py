"""The `instcls` command line.

    instcls bench classifier [--num-classes N --batch B --dim D --ranks T --chunk-size C ...]

More subcommands (train, eval, make-shards, plan, ...) arrive with their features.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_bench_classifier(subparsers) -> None:
    from trainer.bench.classifier_bench import ClassifierBenchSettings

    defaults = ClassifierBenchSettings()
    parser = subparsers.add_parser(
        "classifier",
        help="step time, peak memory and GFLOP/s of the DHP classifier vs the replicated (DDP) baseline",
        description="Spawns --ranks local processes per mode (gloo on CPU, NCCL on GPUs) and prints both "
        "modes side by side with their ratios and the plain-matmul roofline.",
    )
    parser.add_argument("--num-classes", type=int, default=defaults.num_classes, help="N (default %(default)s)")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="global batch B (default %(default)s)")
    parser.add_argument("--dim", type=int, default=defaults.dim, help="feature dim D (default %(default)s)")
    parser.add_argument("--ranks", type=int, default=defaults.ranks, help="T processes (default %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=defaults.chunk_size, help="classes per chunk")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed steps (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps (default %(default)s)")
    parser.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    parser.set_defaults(handler=_run_bench_classifier)


def _run_bench_classifier(args: argparse.Namespace) -> int:
    from trainer.bench.classifier_bench import ClassifierBenchSettings, format_report, run

    settings = ClassifierBenchSettings(
        num_classes=args.num_classes,
        batch=args.batch,
        dim=args.dim,
        ranks=args.ranks,
        chunk_size=args.chunk_size,
        steps=args.steps,
        warmup=args.warmup,
        dtype=args.dtype,
    )
    summary = run(settings)
    print(format_report(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="instcls", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks that print side-by-side ratios")
    _add_bench_classifier(bench.add_subparsers(dest="benchmark", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as error:
        print(f"instcls: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
