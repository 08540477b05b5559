"""The `instcls` command line.

    instcls launch TORCHRUN_ARGS...     (torchrun that exits 0 after a clean preemption save)
    instcls train --config FILE [--set section.field=value ...] [--resume auto|none|PATH]   (under torchrun)
    instcls eval knn|linear --config FILE --checkpoint DIR
    instcls report --logs DIR [--png FILE]   (a finished run: summary table, curves)
    instcls ablate [--only NAME,...] [--seeds 2] [--doc docs/ablations.md]   (the papers' ablations, CPU ranks)
    instcls make-shards --source digits|digit-scenes|synthetic|folder --out DIR [...]
    instcls validate-shards DIR
    instcls drill [--only NAME,...]   (fault drills on CPU ranks; prints what survived)
    instcls bench classifier [--num-classes N --batch B --dim D --ranks T --chunk-size C --co2 ...]
    instcls bench data [--shards DIR --batch B --threads T --views V ...]
    instcls bench ddp-vs-dhp --ranks T --cap-gib C [--out DIR ...]
    instcls bench exporter [--scrapers 50 --seconds 10 --rounds 3]
    instcls bench pic [--sizes 1281167,14197087,max --store disk --store-dir DIR --cap-gib 16 ...]
    instcls plan --num-classes N --ranks T --batch B [--backbone resnet50 --gpu-memory-gib 32 ...]
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
        help="step time, peak memory and useful GFLOP/s of the DHP classifier vs the DDP baseline",
        description="Spawns --ranks local processes per mode and logits handling (recomputed in the backward, "
        "or kept in the logits cache; gloo on CPU, NCCL on GPUs) and prints the four runs side by side with "
        "their ratios and a plain matmul of the same shapes.",
    )
    parser.add_argument("--num-classes", type=int, default=defaults.num_classes, help="N (default %(default)s)")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="global batch B (default %(default)s)")
    parser.add_argument("--dim", type=int, default=defaults.dim, help="feature dim D (default %(default)s)")
    parser.add_argument("--ranks", type=int, default=defaults.ranks, help="T processes (default %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=defaults.chunk_size,
                        help="classes per chunk (default: 2048 on CPU, 65536 on GPUs)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed steps (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps (default %(default)s)")
    parser.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--co2", action="store_true",
                        help="instead: the step-time overhead of CO2's fused consistency term over the plain loss")
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
    if args.co2:
        from trainer.bench.co2_bench import format_co2_report, run_co2

        summary = run_co2(settings)
        print(format_co2_report(settings, summary))
    else:
        summary = run(settings)
        print(format_report(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


def _add_bench_pic(subparsers) -> None:
    from trainer.bench.pic_bench import PicBenchSettings

    defaults = PicBenchSettings()
    parser = subparsers.add_parser(
        "pic", help="PIC's step time and memory vs N (rows in a row store) next to the full-softmax DHP",
        description="Runs the pic objective with recent-negative sampling and its rows in a store for each N, and "
        "the full-softmax DHP classifier at the same N under a memory cap, each in a fresh process.")
    parser.add_argument("--sizes", default=",".join(defaults.sizes),
                        help="comma-separated N; 'max' = the largest N whose store fits on the disk (default %(default)s)")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="images per step, 2 views each")
    parser.add_argument("--queue", type=int, default=defaults.queue, help="K recent ids (default %(default)s)")
    parser.add_argument("--dim", type=int, default=defaults.dim)
    parser.add_argument("--chunk-size", type=int, default=defaults.chunk_size)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed steps per N")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps per N")
    parser.add_argument("--store", default=defaults.store, choices=["device", "host", "disk"])
    parser.add_argument("--store-dir", help="where a disk store goes (default: a temporary directory)")
    parser.add_argument("--cap-gib", type=float, default=defaults.cap_gib, help="full-softmax memory cap")
    parser.add_argument("--full-max-classes", type=int, default=defaults.full_max_classes,
                        help="time full-softmax steps up to this N only (a step is O(N))")
    parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    parser.set_defaults(handler=_run_bench_pic)


def _run_bench_pic(args: argparse.Namespace) -> int:
    from trainer.bench.pic_bench import PicBenchSettings, format_report, run, write_json

    settings = PicBenchSettings(
        sizes=tuple(args.sizes.split(",")), batch=args.batch, queue=args.queue, dim=args.dim,
        chunk_size=args.chunk_size, steps=args.steps, warmup=args.warmup, store=args.store, store_dir=args.store_dir,
        cap_gib=args.cap_gib, full_max_classes=args.full_max_classes,
    )
    report = run(settings)
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
    return 0


def _add_make_shards(commands) -> None:
    from data_pipeline.scenes import DIGIT_FRACTION, MAX_ANGLE
    from data_pipeline.shards import ShardSettings

    defaults = ShardSettings()
    parser = commands.add_parser("make-shards", help="write WebDataset shards + DALI indexes + manifest")
    parser.add_argument("--source", required=True, choices=["digits", "digit-scenes", "synthetic", "folder"],
                        help="digits: the labelled set inside scikit-learn; digit-scenes: those digits drawn "
                        "at random places and colours onto photo crops, gradients or flat colours (harder); "
                        "synthetic: random images; "
                        "folder: an image tree ROOT/<class>/<image> given with --root")
    parser.add_argument("--out", type=Path, required=True, help="output directory (must hold no manifest yet)")
    parser.add_argument("--root", type=Path, help="image-folder root for --source folder")
    parser.add_argument("--count", type=int, default=1000, help="number of synthetic images")
    parser.add_argument("--image-size", type=int, default=32, help="side of digits/digit-scenes/synthetic images in pixels")
    parser.add_argument("--split", default="all", choices=["all", "train", "val"],
                        help="digits and digit-scenes: the fixed 20%% held-out digits (val) or the rest (train)")
    parser.add_argument("--renders-per-digit", type=int, default=3,
                        help="digit-scenes: scenes drawn per digit (default %(default)s)")
    parser.add_argument("--backgrounds", type=int, default=0,
                        help="digit-scenes: number of shared background crops (default 0: a fresh crop per scene)")
    parser.add_argument("--background", default="photo", choices=["photo", "gradient", "flat"],
                        help="digit-scenes: crops of embedded photos, two-colour gradients or one flat colour "
                        "(default %(default)s; the demo uses flat)")
    parser.add_argument("--colour-mix", type=float, default=0.3,
                        help="digit-scenes: how much of a random colour survives in the digit (0: black or white; "
                        "default %(default)s)")
    parser.add_argument("--max-angle", type=float, default=MAX_ANGLE,
                        help="digit-scenes: largest turn of a digit in degrees (default %(default)s)")
    parser.add_argument("--digit-size", type=float, nargs=2, default=DIGIT_FRACTION, metavar=("MIN", "MAX"),
                        help="digit-scenes: range of a digit's side as a fraction of the image's (default %(default)s)")
    parser.add_argument("--prefix", default=defaults.prefix, help="shard file prefix: PREFIX-000000.tar")
    parser.add_argument("--samples-per-shard", type=int, default=defaults.samples_per_shard)
    parser.add_argument("--on-bad-image", default=defaults.on_bad_image, choices=["error", "skip"],
                        help="refuse the whole run on an undecodable image (default) or skip and count it")
    parser.add_argument("--max-side", type=int, help="shrink images whose longer side exceeds this")
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="seed of the stored sample order (and of synthetic images and digit scenes)")
    parser.add_argument("--workers", type=int, default=defaults.workers, help="processes that check/encode images")
    parser.set_defaults(handler=_run_make_shards)


def _run_make_shards(args: argparse.Namespace) -> int:
    from data_pipeline import sources
    from data_pipeline.shards import ShardSettings, write_shards

    if args.source == "folder":
        if args.root is None:
            raise ValueError("--source folder needs --root ROOT (a directory with one subfolder per class)")
        source = sources.image_folder(args.root)
    elif args.source == "digits":
        source = sources.sklearn_digits(args.image_size, split=args.split)
    elif args.source == "digit-scenes":
        source = sources.digits_on_photos(args.image_size, split=args.split,
                                          renders_per_digit=args.renders_per_digit, seed=args.seed,
                                          backgrounds=args.backgrounds, background=args.background,
                                          colour_mix=args.colour_mix, max_angle=args.max_angle,
                                          digit_fraction=tuple(args.digit_size))
    else:
        source = sources.synthetic(args.count, args.image_size, args.seed)
    settings = ShardSettings(prefix=args.prefix, samples_per_shard=args.samples_per_shard,
                             on_bad_image=args.on_bad_image, seed=args.seed, workers=args.workers,
                             max_side=args.max_side)
    manifest = write_shards(source, args.out, settings)
    print(f"wrote {manifest.num_instances} instances in {len(manifest.shards)} shard(s) to {args.out}"
          + (f"; skipped {len(manifest.skipped)} unreadable image(s), listed in the manifest" if manifest.skipped else ""))
    return 0


def _add_validate_shards(commands) -> None:
    parser = commands.add_parser("validate-shards", help="decode and check every sample of a shard set")
    parser.add_argument("shards", type=Path, help="directory with manifest.json")
    parser.add_argument("--workers", type=int, default=2, help="processes that check shards in parallel")
    parser.set_defaults(handler=_run_validate_shards)


def _run_validate_shards(args: argparse.Namespace) -> int:
    from data_pipeline.validate import validate_shards

    checked, problems = validate_shards(args.shards, workers=args.workers)
    for problem in problems:
        print(f"PROBLEM {problem}")
    print(f"checked {checked} samples in {args.shards}: " + (f"{len(problems)} problem(s)" if problems else "all good"))
    return 1 if problems else 0


def _add_bench_data(subparsers) -> None:
    from trainer.bench.data_bench import DataBenchSettings

    defaults = DataBenchSettings()
    parser = subparsers.add_parser("data", help="images/s of the DALI loader vs the PIL + torchvision fallback")
    parser.add_argument("--shards", type=Path, help="shard directory (default: synthetic shards in a temp dir)")
    parser.add_argument("--synthetic-count", type=int, default=defaults.synthetic_count)
    parser.add_argument("--image-size", type=int, default=defaults.image_size, help="synthetic image side")
    parser.add_argument("--crop-size", type=int, default=defaults.crop_size, help="side of the global views")
    parser.add_argument("--views", type=int, default=defaults.views)
    parser.add_argument("--small-crops", type=int, default=defaults.small_crops)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--threads", type=int, default=defaults.threads, help="DALI threads = DataLoader workers")
    parser.add_argument("--batches", type=int, default=defaults.batches, help="timed batches")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed batches")
    parser.add_argument("--multicrop", type=int, default=defaults.multicrop,
                        help="small views of the multi-crop recipe measured too (0: only the configured views)")
    parser.set_defaults(handler=_run_bench_data)


def _run_bench_data(args: argparse.Namespace) -> int:
    from trainer.bench.data_bench import DataBenchSettings, format_report, run

    settings = DataBenchSettings(
        shards=args.shards, synthetic_count=args.synthetic_count, image_size=args.image_size,
        crop_size=args.crop_size, views=args.views, small_crops=args.small_crops, batch=args.batch,
        threads=args.threads, batches=args.batches, warmup=args.warmup, multicrop=args.multicrop,
    )
    print(format_report(settings, run(settings)))
    return 0


def _add_bench_ddp_vs_dhp(subparsers) -> None:
    from trainer.bench.ddp_vs_dhp import SweepSettings

    d = SweepSettings()
    parser = subparsers.add_parser(
        "ddp-vs-dhp", help="largest N, memory and step time of DDP vs DHP under a per-rank memory cap",
        description="Sweeps N up to the allocation failure for both modes; writes points.csv, table.md (paper "
        "Table 1), memory.png (paper Figure 3) and summary.json to --out.")
    parser.add_argument("--ranks", type=int, default=d.ranks)
    parser.add_argument("--batch", type=int, default=d.batch, help="global batch")
    parser.add_argument("--dim", type=int, default=d.dim)
    parser.add_argument("--chunk-size", type=int, default=d.chunk_size)
    parser.add_argument("--logits-cache-gib", type=float, default=d.logits_cache_bytes / 2**30,
                        help="logits cache budget per rank (GiB; 0 recomputes the logits in the backward)")
    parser.add_argument("--cap-gib", type=float, default=d.cap_gib, help="memory cap per rank (GiB)")
    parser.add_argument("--start-classes", type=int, default=d.start_classes)
    parser.add_argument("--growth", type=float, default=d.growth)
    parser.add_argument("--refine-steps", type=int, default=d.refine_steps, help="bisection steps at the boundary")
    parser.add_argument("--steps", type=int, default=d.steps, help="timed steps per point")
    parser.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--update-in-backward", action="store_true", help="DHP applies SGD inside the backward")
    parser.add_argument("--backbone", choices=["resnet18", "resnet50"], help="add a real backbone on random images")
    parser.add_argument("--image-size", type=int, default=d.image_size)
    parser.add_argument("--classes", type=int, nargs="+", help="measure only these N (no sweep)")
    parser.add_argument("--out", type=Path, default=Path("out/ddp-vs-dhp"))
    parser.set_defaults(handler=_run_bench_ddp_vs_dhp)


def _add_bench_exporter(subparsers) -> None:
    from trainer.bench.exporter_bench import ExporterBenchSettings

    d = ExporterBenchSettings()
    parser = subparsers.add_parser(
        "exporter", help="step throughput with and without many concurrent /metrics scrapes (loopback)")
    parser.add_argument("--scrapers", type=int, default=d.scrapers, help="concurrent scrapers (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=d.seconds, help="length of each window (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=d.rounds, help="quiet/loaded window pairs (default %(default)s)")
    parser.add_argument("--batch", type=int, default=d.batch)
    parser.add_argument("--image-size", type=int, default=d.image_size)
    parser.add_argument("--arch", default=d.arch, choices=["resnet18", "resnet50"])
    parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    parser.set_defaults(handler=_run_bench_exporter)


def _run_bench_exporter(args: argparse.Namespace) -> int:
    from trainer.bench.exporter_bench import ExporterBenchSettings, format_report, run

    if args.scrapers < 1 or args.rounds < 1 or args.seconds <= 0:
        raise ValueError("bench exporter: --scrapers and --rounds must be >= 1 and --seconds > 0")
    summary = run(ExporterBenchSettings(scrapers=args.scrapers, seconds=args.seconds, rounds=args.rounds,
                                        batch=args.batch, image_size=args.image_size, arch=args.arch))
    print(format_report(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


def _run_bench_ddp_vs_dhp(args: argparse.Namespace) -> int:
    from trainer.bench.ddp_vs_dhp import SweepSettings, run

    settings = SweepSettings(
        ranks=args.ranks, batch=args.batch, dim=args.dim, chunk_size=args.chunk_size,
        logits_cache_bytes=int(args.logits_cache_gib * 2**30), cap_gib=args.cap_gib,
        start_classes=args.start_classes, growth=args.growth, refine_steps=args.refine_steps, steps=args.steps,
        dtype=args.dtype, update_in_backward=args.update_in_backward, backbone=args.backbone,
        image_size=args.image_size,
    )
    _, table = run(settings, args.out, progress=lambda line: print(line, flush=True), classes=args.classes)
    print(table)
    print(f"wrote {args.out}/points.csv, table.md, memory.png, summary.json")
    return 0


def _add_plan(commands) -> None:
    parser = commands.add_parser("plan", help="predict per-GPU memory of a job for DDP, DHP and PIC, and the largest N")
    parser.add_argument("--num-classes", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True, help="GPUs (T)")
    parser.add_argument("--batch", type=int, default=4096, help="global images per step")
    parser.add_argument("--views", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=65536)
    parser.add_argument("--logits-cache-gib", type=float, default=0.0,
                        help="classifier.logits_cache_bytes in GiB: keep the logits for the backward if they fit")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--backbone", choices=["resnet18", "resnet34", "resnet50", "resnet101"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--no-momentum", action="store_true", help="plain SGD (no momentum buffers)")
    parser.add_argument("--update-in-backward", action="store_true", help="DHP: no full gradient of W")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per GPU (or per rank)")
    parser.add_argument("--cpu", action="store_true", help="plan CPU ranks (no CUDA context / NCCL buffers)")
    parser.add_argument("--queue", type=int, default=65536, help="PIC: K recent ids scored besides the batch")
    parser.add_argument("--row-store", default="host", choices=["device", "host", "disk"],
                        help="PIC: where W and its momentum live (device counts them in device memory)")
    parser.add_argument("--co2", action="store_true", help="add CO2's consistency term (co2_alpha > 0)")
    parser.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from trainer.bench.planner import GIB, PlanInput, format_plan

    plan = PlanInput(
        mode="dhp", num_classes=args.num_classes, ranks=args.ranks, batch=args.batch, dim=args.dim,
        chunk_size=args.chunk_size, logits_cache_bytes=int(args.logits_cache_gib * GIB), dtype=args.dtype,
        momentum=not args.no_momentum,
        update_in_backward=args.update_in_backward, backbone=args.backbone, image_size=args.image_size,
        views=args.views, zero_stage=args.zero_stage, device="cpu" if args.cpu else "gpu", queue=args.queue,
        row_store=args.row_store, co2=args.co2,
    )
    print(format_plan(plan, int(args.gpu_memory_gib * GIB)))
    return 0


def _add_config_arguments(parser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="job config YAML (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config value (repeatable), e.g. --set optim.epochs=3")


def _add_drill(commands) -> None:
    from trainer.drills.catalogue import DRILLS

    parser = commands.add_parser(
        "drill", help="break real 2-rank CPU jobs the way a cluster does and print what survived",
        description="Runs each fault drill (SIGKILL mid-step and mid-save, a damaged checkpoint, a full disk, "
        "SIGTERM, NaN, taken ports, pickled code, a damaged shard) on the embedded digits and prints a table: "
        "fault, what happened, data lost, time to recover.  Exits 1 if any drill failed.")
    parser.add_argument("--only", type=lambda text: text.split(","), default=list(DRILLS),
                        help=f"comma-separated drills (default: all of {', '.join(DRILLS)})")
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


def _add_train(commands) -> None:
    parser = commands.add_parser("train", help="train under torchrun or the deepspeed launcher")
    _add_config_arguments(parser)
    parser.add_argument("--resume", default="auto",
                        help="auto (newest complete checkpoint, else start fresh), none, or a checkpoint path")
    # The deepspeed launcher appends --local_rank; the rank is read from the environment instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    parser.set_defaults(handler=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from trainer.config import load_job_config
    from trainer.engine.save_guard import CheckpointInterrupted, CheckpointWriteError
    from trainer.engine.preemption import NonFiniteLossError
    from trainer.engine.trainer import Trainer
    from trainer.parallel import init_distributed
    from trainer.parallel.dims import shutdown_distributed
    from trainer.parallel.host_memory import keep_freed_host_memory

    config = load_job_config(args.config, args.overrides)
    dims = init_distributed(config.parallel.classifier_parallel_size)
    keep_freed_host_memory(dims.device)  # CPU ranks: chunk temporaries stop page-faulting
    try:
        result = Trainer(config, dims, resume=args.resume).train()
    except NonFiniteLossError as error:
        print(f"instcls: rank {dims.rank}: {error}", file=sys.stderr)
        return 3
    except (CheckpointWriteError, CheckpointInterrupted) as error:
        print(f"instcls: error: {error}", file=sys.stderr)
        return 4
    finally:
        shutdown_distributed()
    if dims.rank == 0:
        print(f"instcls train: stopped ({result.stopped_by}) at epoch {result.state.epoch} step "
              f"{result.state.global_step}; last checkpoint {result.last_checkpoint}")
    return 0


def _add_eval(commands) -> None:
    parser = commands.add_parser("eval", help="kNN or linear-probe accuracy of a checkpoint's frozen backbone")
    parser.add_argument("protocol", choices=["knn", "linear"])
    _add_config_arguments(parser)
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint directory, 'auto' for the newest, or 'random-init' for the untrained "
                        "network of the config's seed (the baseline a trained one must beat)")
    parser.set_defaults(handler=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    import torch

    from trainer.config import load_job_config
    from trainer.engine.checkpoint_files import load_model_weights, resolve_resume
    from trainer.engine.rng_state import reseed
    from trainer.evaluation.features import bank_and_queries
    from trainer.evaluation.knn import knn_accuracy
    from trainer.evaluation.linear import linear_probe_accuracy
    from trainer.models import build_model
    from trainer.parallel import init_distributed

    config = load_job_config(args.config, args.overrides)
    if config.data.eval_shards is None:
        raise ValueError(f"{args.config}: data.eval_shards is not set; point it at a labelled held-out shard set")
    if args.checkpoint == "random-init":
        checkpoint = "random-init"
        reseed(config.seed, 0, 0)  # the trainer's initial network
        model = build_model(config.model)
    else:
        checkpoint = resolve_resume(args.checkpoint, config.checkpoint.dir)
        if checkpoint is None:
            raise FileNotFoundError(f"no complete checkpoint in {config.checkpoint.dir}")
        model = build_model(config.model)
        model.load_state_dict(load_model_weights(checkpoint))
    dims = init_distributed()
    model.to(dims.device)
    bank, bank_labels, queries, query_labels = bank_and_queries(model, config.data, dims)
    if args.protocol == "knn":
        accuracy = knn_accuracy(bank, bank_labels, queries, query_labels, config.eval.knn_k, config.eval.knn_temperature)
        label = f"kNN (k={config.eval.knn_k}, cosine)"
    else:
        accuracy = linear_probe_accuracy(bank, bank_labels, queries, query_labels)
        label = "linear probe"
    if dims.rank == 0:
        print(f"{label} accuracy of {checkpoint}: {100 * accuracy:.2f}%")
    return 0


def _add_report(commands) -> None:
    parser = commands.add_parser("report", help="a finished run's summary table and a PNG of its curves, from its logs")
    parser.add_argument("--logs", type=Path, required=True, help="the run's logging.dir (rank-*.jsonl)")
    parser.add_argument("--png", type=Path, help="also write loss, kNN per epoch, throughput and memory here")
    parser.set_defaults(handler=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from trainer.observability.report import RunLogs, plot_run, summary_table

    logs = RunLogs.read(args.logs)
    print(summary_table(logs))
    if args.png:
        print(f"curves: {plot_run(logs, args.png)}")
    return 0


def _add_ablate(commands) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="instcls", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_train(commands)
    _add_eval(commands)
    _add_report(commands)
    _add_ablate(commands)
    _add_plan(commands)
    _add_make_shards(commands)
    _add_validate_shards(commands)
    _add_drill(commands)
    bench = commands.add_parser("bench", help="benchmarks that print side-by-side ratios")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    _add_bench_classifier(benchmarks)
    _add_bench_data(benchmarks)
    _add_bench_ddp_vs_dhp(benchmarks)
    _add_bench_pic(benchmarks)
    _add_bench_exporter(benchmarks)
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
        if not isinstance(error, _errors_users_fix()):
            raise
        print(f"instcls: error: {error}", file=sys.stderr)
        return 2


def _errors_users_fix() -> tuple[type[Exception], ...]:
    """Errors whose message says what to fix: printed as one line, not a traceback."""
    from data_pipeline.sample_table import ShardReadError
    from trainer.engine.safe_load import UnsafeCheckpointError

    return ValueError, FileNotFoundError, FileExistsError, ShardReadError, UnsafeCheckpointError


if __name__ == "__main__":
    sys.exit(main())
