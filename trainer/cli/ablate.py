"""`instcls ablate`: the papers' ablations in miniature, judged against seed noise, written to a document."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands) -> None:
    from trainer.ablations.catalogue import ABLATIONS

    parser = commands.add_parser(
        "ablate", help="the papers' ablations in miniature on the digit scenes; writes docs/ablations.md",
        description="Trains every variant of each ablation at several seeds (2 CPU ranks per run, one run "
        "at a time), judges each published direction against the seeds' noise and writes a Markdown "
        "document with a table and a PNG.  Finished runs are kept and not repeated.  Ablations: "
        + ", ".join(a.name for a in ABLATIONS) + ".")
    parser.add_argument("--only", help="comma-separated ablation names (default: all)")
    parser.add_argument("--seeds", type=int, default=2, help="runs per variant, seeds 0..N-1 (default %(default)s)")
    parser.add_argument("--train-shards", type=Path, default=Path("out/demo/shards/train"),
                        help="the digit scenes' training split (default: the demo's, %(default)s)")
    parser.add_argument("--val-shards", type=Path, default=Path("out/demo/shards/val"),
                        help="their labelled held-out split (default %(default)s)")
    parser.add_argument("--work-dir", type=Path, default=Path("out/ablate"), help="runs go here (default %(default)s)")
    parser.add_argument("--doc", type=Path, default=Path("docs/ablations.md"),
                        help="the Markdown document to write; its PNG goes next to it (default %(default)s)")
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks per run (default %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a config override for every run (repeatable), e.g. optim.epochs=1 for a smoke test")
    parser.set_defaults(handler=_run_ablate)


def _run_ablate(args: argparse.Namespace) -> int:
    from trainer.ablations.catalogue import select
    from trainer.ablations.document import Sweep, summary_table, verdicts_of, write
    from trainer.ablations.runner import SweepSettings, repo_relative, run_sweep

    if args.seeds < 1:
        raise ValueError(f"--seeds {args.seeds} is invalid: use at least 1 (several, for a noise estimate)")
    for split, path in (("--train-shards", args.train_shards), ("--val-shards", args.val_shards)):
        if not (path / "manifest.json").is_file():
            raise FileNotFoundError(f"{split} {path}: no shard set there; build the digit scenes first with "
                                    "`make ablate` (or the make-shards commands of `make demo`)")
    ablations = select(args.only.split(",") if args.only else None)
    settings = SweepSettings(repo_relative(args.train_shards), repo_relative(args.val_shards),
                             repo_relative(args.work_dir), args.seeds, args.nproc, tuple(args.overrides))
    results = run_sweep(settings, ablations, report=lambda line: print(line, flush=True))
    command = "instcls ablate" + (f" --only {args.only}" if args.only else "") + f" --seeds {args.seeds}"
    sweep = Sweep(settings, ablations, results, command)
    markdown, png = write(sweep, args.doc)
    print("\n".join(summary_table(sweep, verdicts_of(sweep))))
    print(f"wrote {markdown} and {png}")
    return 0
