"""The `instcls` command line.

    instcls --version
    instcls launch TORCHRUN_ARGS...     (torchrun with Kubernetes exit codes: 0 done, 143 preempted, 2-4 permanent)
    instcls train --config FILE [--set section.field=value ...] [--resume auto|none|PATH]   (under torchrun)
    instcls eval knn|linear [--config FILE] --checkpoint DIR   (the config from the checkpoint's run.json)
    instcls export [--config FILE] --checkpoint auto|DIR --out DIR [--with-head] [--force]   (timm/torchvision weights)
    instcls report --logs DIR [--png FILE]   (a finished run: summary table, curves)
    instcls ablate [--only NAME,...] [--seeds 2] [--doc docs/ablations.md]   (the papers' ablations, CPU ranks)
    instcls make-shards --source folder|list|tars|digits|digit-scenes|synthetic --out DIR [--part I/K ...]
    instcls merge-shards DIR [--wait S]   (after the parts)
    instcls upgrade-shards DIR   (a shard set from an older make-shards)
    instcls validate-shards DIR
    instcls drill [--only NAME,...]   (fault drills on CPU ranks; prints what survived)
    instcls bench classifier [--num-classes N --batch B --dim D --ranks T --chunk-size C --co2 --peer torch ...]
    instcls bench data [--shards DIR --batch B --threads T --views V ...]
    instcls bench ddp-vs-dhp --ranks T --cap-gib C [--out DIR ...]
    instcls bench cli [--repeats 5]   (`instcls --help` beside `import torch`, in fresh processes)
    instcls bench exporter [--scrapers 50 --seconds 10 --rounds 3]
    instcls bench pic [--sizes 1281167,14197122,max --store disk --store-dir DIR --cap-gib 16 ...]
    instcls bench scale [--num-samples 14197122 --ranks 64 ...]   (one epoch's bookkeeping, no images)
    instcls bench ingest [--images 2000 --workers 1,2 ...]   (make-shards images/s per core)
    instcls bench step --config FILE [--ranks 2 --steps 20 --shards DIR --loader-only]   (the whole step by phase)
    instcls plan --num-classes N --ranks T --batch B [--backbone resnet50 --gpu-memory-gib 32 ...]
    instcls dry-run --config FILE --ranks T [--rank R --num-instances N]   (the step on fake CUDA devices)
"""

from __future__ import annotations

import argparse
import sys

# One module per command area; each registers its commands and calls the code that does the work.
from trainer.cli import ablate, bench, drill, dry_run, evaluation, export, plan, selftest, shards, training
from trainer.cli.version_flag import PrintCodeIdentity
from trainer.exit_codes import ExitCode, record_failure_cause


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="instcls", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action=PrintCodeIdentity)  # the version, the commit and the image
    commands = parser.add_subparsers(dest="command", required=True)
    # the order of `instcls --help`
    for area in (training, evaluation, export, ablate, plan, dry_run, shards, drill, bench, selftest):
        area.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # everything after `launch` belongs to torchrun
        from trainer.parallel.launch import launch

        return launch(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except Exception as error:
        code = _code_of(error)
        if code is None:
            raise
        line = f"instcls: error: {error}"
        print(line, file=sys.stderr)
        record_failure_cause(line)  # `instcls launch` ends with it, after every peer's traceback
        return code


def _code_of(error: Exception) -> int | None:
    """The exit code of an error whose message says it all (printed as one line, not a traceback),
    or None for any other."""
    from data_pipeline.storage.storage_errors import StorageUnavailableError

    if isinstance(error, StorageUnavailableError):  # the store is down: the Job's counted retry resumes the run
        return ExitCode.CRASHED
    return ExitCode.BAD_INPUT if isinstance(error, _errors_users_fix()) else None


def _errors_users_fix() -> tuple[type[Exception], ...]:
    """Errors whose message says what to fix: printed as one line, not a traceback."""
    from data_pipeline.shardset.sample_table import ShardReadError
    from trainer.checkpoint.safe_load import UnsafeCheckpointError

    return ValueError, FileNotFoundError, FileExistsError, ShardReadError, UnsafeCheckpointError
