"""`instcls train` (one rank of a job, under torchrun or the deepspeed launcher) and the job-config
options it shares with `instcls eval`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_config_options(parser: argparse.ArgumentParser, config_help: str | None = None) -> None:
    """``--config`` (required, unless ``config_help`` says what is used without it) and ``--set``."""
    parser.add_argument("--config", type=Path, required=config_help is None,
                        help=config_help or "job config YAML (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config value (repeatable), e.g. --set optim.epochs=3")


def register(commands) -> None:
    parser = commands.add_parser("train", help="train under torchrun or the deepspeed launcher")
    add_config_options(parser)
    parser.add_argument("--resume", default="auto",
                        help="auto (newest complete checkpoint, else start fresh), none, or a checkpoint path")
    # The deepspeed launcher appends --local_rank; the rank is read from the environment instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    parser.set_defaults(handler=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    """One rank's exit code (``trainer.exit_codes``): what `instcls launch` and Kubernetes act on."""
    from trainer.checkpoint.save_guard import CheckpointInterrupted, CheckpointWriteError
    from trainer.config import load_job_config
    from trainer.engine.stop_conditions import NonFiniteLossError
    from trainer.engine.trainer import Trainer
    from trainer.engine.training_job import training_process_group
    from trainer.exit_codes import ExitCode
    from trainer.export.card_only import model_card_of
    from trainer.provenance.run_start import ConfigOrigin

    config = load_job_config(args.config, args.overrides)
    with training_process_group(config) as dims:  # what trainer.train() runs too
        try:
            origin = ConfigOrigin(args.config, tuple(args.overrides))  # run.json: the file and the --set as given
            result = Trainer(config, dims, resume=args.resume, origin=origin, model_card=model_card_of).train()
        except NonFiniteLossError as error:
            return _failed(f"instcls: rank {dims.rank}: {error}", ExitCode.NONFINITE_LOSS)
        except CheckpointWriteError as error:
            return _failed(f"instcls: error: {error}", ExitCode.CHECKPOINT_WRITE_FAILED)
        except CheckpointInterrupted as error:
            # Not this rank's fault: the rank that failed first exits with the code that says why.
            print(f"instcls: error: {error}", file=sys.stderr)
            return ExitCode.CRASHED
    code = ExitCode.PREEMPTED if result.stopped_by == "sigterm" else ExitCode.FINISHED
    if dims.rank == 0:
        print(f"instcls train: stopped ({result.stopped_by}) at epoch {result.state.epoch} step "
              f"{result.state.global_step}; last checkpoint {result.last_checkpoint}; exiting {int(code)}", flush=True)
    return code


def _failed(line: str, code: int) -> int:
    """Print why this rank stops and hand the line to `instcls launch`, which ends with it."""
    from trainer.exit_codes import record_failure_cause

    print(line, file=sys.stderr)
    record_failure_cause(line)
    return code
