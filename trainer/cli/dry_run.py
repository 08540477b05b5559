"""`instcls dry-run`: the job's step at full scale on fake CUDA devices, on a machine without a GPU."""

from __future__ import annotations

import argparse
from pathlib import Path


def _ranks(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: use comma-separated ranks, e.g. 0,1,63") from None


def register(commands) -> None:
    parser = commands.add_parser(
        "dry-run", help="run the job's step at full N as one rank of T on fake CUDA devices (no GPU needed)",
        description="Builds the job's objective at its full N on fake CUDA tensors as rank R of T (a 'fake' process "
        "group: no data moves), runs a few steps with stand-in head features, and prints the step's peak memory "
        "next to `instcls plan`, every host sync with its source line, any device mismatch, and whether the "
        "collectives of a few simulated ranks agree.  Exits 1 if it found any of these.  See docs/dry_run.md.")
    parser.add_argument("--config", type=Path, required=True, help="the job config (configs/*.yaml)")
    parser.add_argument("--ranks", type=int, required=True, help="T, the job's number of GPUs")
    parser.add_argument("--rank", type=int, default=0, help="R, the rank reported (default 0)")
    parser.add_argument("--compare", type=_ranks,
                        help="ranks simulated to compare collectives (default: R, 0, 8 and T-1)")
    parser.add_argument("--num-instances", type=int,
                        help="N (default: the config's training shard set, if it is on this machine)")
    parser.add_argument("--steps", type=int, default=3, help="steps per simulated rank (PIC writes rows back "
                        "once its queue is full: about queue_size / global batch steps)")
    parser.add_argument("--epoch", type=int, default=0, help="the epoch whose first steps run (e.g. SwAV's "
                        "queue_start_epoch)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="section.field=value")
    parser.add_argument("--on-device", action="store_true", help="then run rank R's same step on this machine's "
                        "GPU (real tensors, the same fake process group) and print its measured peak and host syncs "
                        "beside the prediction (docs/dry_run.md)")
    parser.set_defaults(handler=_run_dry_run)


def _run_dry_run(args: argparse.Namespace) -> int:
    from trainer.config import load_job_config
    from trainer.dry_run.job import dry_run_job, format_result
    from trainer.planning.plan_from_config import num_instances_of

    config = load_job_config(args.config, args.overrides)
    if args.ranks < 1 or args.steps < 1:
        raise ValueError("--ranks and --steps must be >= 1")
    try:
        num_instances = num_instances_of(config, args.num_instances)
    except ValueError as error:  # its text names `instcls plan`'s flag
        raise ValueError(str(error).replace("--num-classes", "--num-instances")) from None
    result = dry_run_job(config, num_instances, args.ranks, args.rank, args.compare, args.steps, args.epoch,
                         progress=lambda line: print(line, flush=True))
    print(format_result(result, config, str(args.config)), flush=True)
    if not args.on_device:
        return 0 if result.clean else 1
    from trainer.dry_run.on_device import format_comparison, run_rank_on_device

    measured = run_rank_on_device(config, num_instances, args.ranks, args.rank, args.steps, args.epoch)
    print(format_comparison(result, measured))
    return 0 if result.clean and measured.agrees() else 1
