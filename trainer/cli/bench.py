"""`instcls bench ...`: the benchmarks.  Each one's options are its settings dataclass's fields
(see ``settings_options``); only what is not a setting (output files, a mode switch, a unit) is
declared here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainer.cli.settings_options import add_settings_options, settings_from_args

GIB = 2**30


def register(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print side-by-side ratios")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    _add_classifier(benchmarks)
    _add_data(benchmarks)
    _add_ddp_vs_dhp(benchmarks)
    _add_pic(benchmarks)
    _add_exporter(benchmarks)
    _add_scale(benchmarks)
    _add_ingest(benchmarks)
    _add_checkpoint(benchmarks)
    _add_step(benchmarks)
    _add_eval(benchmarks)
    _add_cli(benchmarks)


def _add_bench(benchmarks, name: str, settings_class: type, handler, help: str, description: str | None = None,
               skip: tuple[str, ...] = (), json_output: bool = True) -> argparse.ArgumentParser:
    """The parser of `instcls bench NAME`: the settings' options, then ``--json`` when the bench
    writes its numbers; the caller adds what is not a setting."""
    parser = benchmarks.add_parser(name, help=help, description=description)
    add_settings_options(parser, settings_class, skip)
    if json_output:
        parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    parser.set_defaults(handler=handler)
    return parser


def _add_classifier(benchmarks) -> None:
    from trainer.bench.settings.classifier import ClassifierBenchSettings
    from trainer.bench.settings.torch_peer import TorchPeerSettings

    parser = _add_bench(
        benchmarks, "classifier", ClassifierBenchSettings, _run_classifier,
        help="step time, peak memory and useful GFLOP/s of the DHP classifier vs the DDP baseline",
        description="Spawns --ranks local processes per mode and logits handling (recomputed in the backward, "
        "or kept in the logits cache; gloo on CPU, NCCL on GPUs) and prints the four runs side by side with "
        "their ratios and a plain matmul of the same shapes.")
    parser.add_argument("--co2", action="store_true",
                        help="instead: the step-time overhead of CO2's fused consistency term over the plain loss")
    add_settings_options(parser, TorchPeerSettings)  # --peer torch and its options


def _run_classifier(args: argparse.Namespace) -> int:
    from trainer.bench.classifier_bench import ClassifierBenchSettings, format_report, run

    settings = settings_from_args(ClassifierBenchSettings, args)
    if args.peer:
        return _run_classifier_peer(args, settings)
    if args.co2:
        from trainer.bench.co2_bench import format_co2_report, run_co2

        summary = run_co2(settings)
        return _report(args, format_co2_report(settings, summary), summary)
    summary = run(settings)
    return _report(args, format_report(summary), summary)


def _run_classifier_peer(args: argparse.Namespace, settings) -> int:
    """`bench classifier --peer torch`: exit status 1 when instcls and torch's op disagree."""
    from trainer.bench.settings.torch_peer import TorchPeerSettings
    from trainer.bench.torch_peer import format_report, run

    if args.co2:
        raise ValueError("--co2 and --peer are two different benchmarks: give one of them")
    summary = run(settings, settings_from_args(TorchPeerSettings, args), progress=lambda line: print(line, flush=True))
    _report(args, format_report(summary), summary)
    return 1 if summary["agreement"] and not summary["agreement"]["agree"] else 0


def _add_data(benchmarks) -> None:
    from trainer.bench.settings.data import DataBenchSettings

    _add_bench(benchmarks, "data", DataBenchSettings, _run_data,
               help="images/s of the DALI loader vs the PIL + torchvision fallback; with --storage, what one rank "
               "asks of the shard store (disk, S3, S3 behind added latency) and what 64 ranks would")


def _run_data(args: argparse.Namespace) -> int:
    from trainer.bench.settings.data import DataBenchSettings

    settings = settings_from_args(DataBenchSettings, args)
    if settings.measures_storage:
        from trainer.bench.storage_bench import format_report, run
    else:
        from trainer.bench.data_bench import format_report, run
    summary = run(settings)
    return _report(args, format_report(settings, summary), summary)


def _add_ddp_vs_dhp(benchmarks) -> None:
    from trainer.bench.settings.ddp_vs_dhp import SweepSettings

    # The cache budget is an option in GiB (below); max_classes and warmup were never options and
    # keep their defaults.
    parser = _add_bench(
        benchmarks, "ddp-vs-dhp", SweepSettings, _run_ddp_vs_dhp, json_output=False,
        skip=("logits_cache_bytes", "max_classes", "warmup"),
        help="largest N, memory and step time of DDP vs DHP under a per-rank memory cap",
        description="Sweeps N up to the allocation failure for both modes; writes points.csv, table.md (paper "
        "Table 1), memory.png (paper Figure 3) and summary.json to --out.")
    parser.add_argument("--logits-cache-gib", type=float, default=SweepSettings().logits_cache_bytes / GIB,
                        help="logits cache budget per rank (GiB; 0 recomputes the logits in the backward)")
    parser.add_argument("--classes", type=int, nargs="+", help="measure only these N (no sweep)")
    parser.add_argument("--out", type=Path, default=Path("out/ddp-vs-dhp"),
                        help="where the tables, plot and summary go (default %(default)s)")
    parser.add_argument("--fake-devices", metavar="CAPS_GIB", type=lambda text: [float(c) for c in text.split(",")],
                        help="instead: execute the classifier's step on fake CUDA devices as rank 0 of --ranks "
                        "(no GPU needed) and print the largest N per mode under each cap, e.g. 32,80 with "
                        "--ranks 64 --batch 4096 for the paper's Figure 3 (ResNet-50 by the planner's formula)")
    parser.add_argument("--on-device", action="store_true",
                        help="with --fake-devices: execute rank 0's step on this machine's GPU instead (real tensors, "
                        "the same fake process group: one GPU plays rank 0 of --ranks), and time both modes at DDP's "
                        "largest N")


def _run_fake_device_sweep(args: argparse.Namespace) -> int:
    from trainer.bench.fake_device_sweep import FakeSweep, format_table, run

    sweep = FakeSweep(ranks=args.ranks, batch=args.batch, dim=args.dim, chunk_size=args.chunk_size,
                      on_device=args.on_device)
    rows = run(args.fake_devices, sweep, progress=lambda line: print(line, flush=True))
    print(format_table(rows, sweep))
    return 0


def _run_ddp_vs_dhp(args: argparse.Namespace) -> int:
    from trainer.bench.ddp_vs_dhp import SweepSettings, run

    if args.fake_devices:
        return _run_fake_device_sweep(args)

    settings = settings_from_args(SweepSettings, args, logits_cache_bytes=int(args.logits_cache_gib * GIB))
    _, table = run(settings, args.out, progress=lambda line: print(line, flush=True), classes=args.classes)
    print(table)
    print(f"wrote {args.out}/points.csv, table.md, memory.png, summary.json")
    return 0


def _add_pic(benchmarks) -> None:
    from trainer.bench.settings.pic import PicBenchSettings

    _add_bench(
        benchmarks, "pic", PicBenchSettings, _run_pic,
        help="PIC's step time and memory vs N (rows in a row store) next to the full-softmax DHP",
        description="Runs the pic objective with recent-negative sampling and its rows in a store for each N, and "
        "the full-softmax DHP classifier at the same N under a memory cap, each in a fresh process.")


def _run_pic(args: argparse.Namespace) -> int:
    from trainer.bench.pic_bench import PicBenchSettings, format_report, run, write_json

    report = run(settings_from_args(PicBenchSettings, args))
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
    return 0


def _add_exporter(benchmarks) -> None:
    from trainer.bench.settings.exporter import ExporterBenchSettings

    _add_bench(benchmarks, "exporter", ExporterBenchSettings, _run_exporter,
               help="step throughput with and without many concurrent /metrics scrapes (loopback)")


def _run_exporter(args: argparse.Namespace) -> int:
    from trainer.bench.exporter_bench import ExporterBenchSettings, format_report, run

    if args.scrapers < 1 or args.rounds < 1 or args.seconds <= 0:
        raise ValueError("bench exporter: --scrapers and --rounds must be >= 1 and --seconds > 0")
    summary = run(settings_from_args(ExporterBenchSettings, args))
    return _report(args, format_report(summary), summary)


def _add_scale(benchmarks) -> None:
    from trainer.bench.settings.scale import ScaleBenchSettings

    _add_bench(benchmarks, "scale", ScaleBenchSettings, _run_scale,
               help="the bookkeeping of one ImageNet-21K epoch without images: time and peak memory vs N",
               description="Opens a synthetic sample table, builds the samplers' permutations and step plans, the "
               "hard-negative index, PIC's recent ids and a checkpoint's row re-split at --num-samples and at "
               "--compare-samples, and prints how each grows with N.")


def _run_scale(args: argparse.Namespace) -> int:
    from trainer.bench.scale_bench import ScaleBenchSettings, format_report, run

    summary = run(settings_from_args(ScaleBenchSettings, args))
    return _report(args, format_report(summary), summary)


def _add_eval(benchmarks) -> None:
    from trainer.bench.settings.evaluation import EvalBenchSettings

    _add_bench(benchmarks, "eval", EvalBenchSettings, _run_eval,
               help="feature extraction images/s, the SGD linear probe beside scikit-learn's, and probe epochs on one "
               "rank's share of ImageNet-1K")


def _run_eval(args: argparse.Namespace) -> int:
    from trainer.bench.eval_bench import EvalBenchSettings, format_report, run

    summary = run(settings_from_args(EvalBenchSettings, args))
    return _report(args, format_report(summary), summary)


def _add_ingest(benchmarks) -> None:
    from trainer.bench.settings.ingest import IngestBenchSettings

    _add_bench(benchmarks, "ingest", IngestBenchSettings, _run_ingest,
               help="make-shards images/s and images/s per worker on photo-like JPEGs (kept, shrunk, tars in place)")


def _run_ingest(args: argparse.Namespace) -> int:
    from trainer.bench.ingest_bench import IngestBenchSettings, format_report, run

    summary = run(settings_from_args(IngestBenchSettings, args))
    return _report(args, format_report(summary), summary)


def _add_checkpoint(benchmarks) -> None:
    from trainer.bench.settings.checkpoint import CheckpointBenchSettings

    _add_bench(
        benchmarks, "checkpoint", CheckpointBenchSettings, _run_checkpoint,
        help="a save's stall (async) vs the synchronous save, load and resharded load, at 64-rank shares",
        description="Local ranks each hold one rank's share of a 64-rank job (its classifier rows, ZeRO partition "
        "and rank 0's consolidated files) and save it through the real checkpoint code, blocking and in the "
        "background, then load it on as many ranks and on another number; one column per data set size.")


def _run_checkpoint(args: argparse.Namespace) -> int:
    from trainer.bench.checkpoint_bench import CheckpointBenchSettings, format_report, run

    summary = run(settings_from_args(CheckpointBenchSettings, args), progress=lambda line: print(line, flush=True))
    return _report(args, format_report(summary), summary)


def _add_step(benchmarks) -> None:
    from trainer.bench.settings.step import StepBenchSettings

    parser = _add_bench(
        benchmarks, "step", StepBenchSettings, _run_step,
        help="the whole training step of a job config: images/s per rank, where the step's time goes, and a "
        "plain PyTorch baseline (--baseline)",
        description="Runs the real trainer of --config on --ranks local processes (GPUs when there are, CPU ranks "
        "otherwise) on one synthetic batch made once on the device (--data synthetic) or through its loader "
        "(--data loader: synthetic shards or --shards, the loader also measured alone); prints per rank images/s, "
        "the seconds per step of each phase (data wait, forward, objective, backward, optimizer, checkpoint), the "
        "ops each phase dispatches, on GPUs its host syncs and CUDA kernels, and with --data loader the loader's "
        "headroom.  --baseline also runs the job's network in a plain PyTorch loop (DDP, torch's foreach/fused "
        "optimizer kernels, no classifier) on the same ranks and batch, and prints the job's images/s over its.")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a value of the job config (repeatable)")


def _run_step(args: argparse.Namespace) -> int:
    from trainer.bench.step_bench import StepBenchSettings, format_report, run

    summary = run(settings_from_args(StepBenchSettings, args), args.overrides)
    return _report(args, format_report(summary), summary)


def _add_cli(benchmarks) -> None:
    from trainer.bench.settings.cli import CliBenchSettings

    _add_bench(benchmarks, "cli", CliBenchSettings, _run_cli,
               help="seconds to `instcls --help` in a fresh process, beside `python -c \"import torch\"`",
               description="Runs `instcls --help`, `python -c \"import torch\"` and `python -c pass` each in fresh "
               "processes, taking turns, and prints their medians and how many times as long torch's import takes.")


def _run_cli(args: argparse.Namespace) -> int:
    from trainer.bench.cli_bench import format_report, run
    from trainer.bench.settings.cli import CliBenchSettings

    summary = run(settings_from_args(CliBenchSettings, args))
    return _report(args, format_report(summary), summary)


def _report(args: argparse.Namespace, text: str, summary: dict) -> int:
    """Print a benchmark's table; with --json, also write its figures there."""
    print(text)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0
