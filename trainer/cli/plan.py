"""`instcls plan`: predicted per-GPU memory of a job (its own objective's with --config; DDP, DHP and
PIC with --num-classes), the largest N, and the ZeRO stage to run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _at_least(minimum: float, kind=int):
    """An argparse type: a number >= ``minimum``, refused with the flag's name otherwise."""
    def parse(text: str):
        value = kind(text)
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"{text} is invalid: use a number >= {minimum}")
        return value
    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is invalid: use a number > 0")
    return value


def register(commands) -> None:
    from trainer.bench.settings.float_dtypes import FLOAT_DTYPES
    from trainer.cli.plan_choices import BACKBONE_NAMES, OPTIMIZER_NAMES
    from trainer.cli.plan_job_flags import default_help

    parser = commands.add_parser("plan", help="predict per-GPU memory of a job (its objective's, or DDP, DHP and PIC), "
                                              "the largest N, and the ZeRO stage to run")
    parser.add_argument("--config", type=Path,
                        help="plan the job this config describes (backbone, batch per rank, views, D, objective, "
                             "DeepSpeed config, loader); N from its training shards unless --num-classes is given")
    parser.add_argument("--num-classes", type=_at_least(1), help="N (required without --config)")
    parser.add_argument("--ranks", type=_at_least(1), required=True, help="GPUs (T)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="with --config: override a value of the job config (repeatable), as `instcls train` "
                        "does; the job flags below are applied as the override each stands for, and printed")
    parser.add_argument("--batch", type=_at_least(1), help="global images per step" + default_help("batch"))
    parser.add_argument("--views", type=_at_least(1), help="views per image" + default_help("views"))
    parser.add_argument("--dim", type=_at_least(1), help="D, the feature width" + default_help("dim"))
    parser.add_argument("--chunk-size", type=_at_least(1), help="classes per chunk" + default_help("chunk_size"))
    parser.add_argument("--logits-cache-gib", type=_at_least(0.0, float),
                        help="objective.logits_cache_bytes in GiB: keep the logits for the backward if they fit"
                        + default_help("logits_cache_gib"))
    parser.add_argument("--dtype", choices=FLOAT_DTYPES, help="the classifier's dtype" + default_help("dtype"))
    parser.add_argument("--backbone", choices=[*BACKBONE_NAMES, "none"],
                        help="counted by default; 'none' plans the classifier alone" + default_help("backbone"))
    parser.add_argument("--image-size", type=_at_least(1), help="the views' side" + default_help("image_size"))
    parser.add_argument("--patch-size", type=_at_least(1),
                        help="ViTs: model.patch_size (default: the name's); the ViT is laid out for --image-size")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                        help="the stage the breakdown is printed at (every stage is planned, the lowest that fits "
                        "is recommended)" + default_help("zero_stage"))
    parser.add_argument("--optimizer", choices=list(OPTIMIZER_NAMES),
                        help="the backbone's optimizer, whose state per parameter is planned (default: the config's "
                        "optim.name, else sgd)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="each residual unit keeps only its input, recomputed in the backward")
    parser.add_argument("--deepspeed-config", type=Path,
                        help="read the ZeRO stage, its bucket sizes and bf16 from this file (ds_configs/*.json)")
    parser.add_argument("--no-dali", action="store_true", help="the loader decodes on the CPU (no DALI buffers)")
    parser.add_argument("--no-momentum", action="store_true",
                        help="SGD without momentum (no momentum buffers for the classifier, nor for an SGD backbone)")
    parser.add_argument("--update-in-backward", action="store_true", help="DHP: no full gradient of W")
    parser.add_argument("--gpu-memory-gib", type=_positive_float, default=80.0, help="memory per GPU (or per rank)")
    parser.add_argument("--cpu", action="store_true",
                        help="plan CPU ranks: no CUDA context / NCCL buffers; the runtime's own memory (measured in a "
                        "fresh process: seconds) and the host copies background checkpoints keep")
    parser.add_argument("--queue", type=_at_least(0),
                        help="PIC: K recent ids scored besides the batch" + default_help("queue"))
    parser.add_argument("--row-store", choices=["device", "host", "disk"],
                        help="PIC: where W and its momentum live (device counts them in device memory)"
                        + default_help("row_store"))
    parser.add_argument("--co2", action="store_true", help="add CO2's consistency term (co2_alpha > 0)")
    parser.add_argument("--kernel", choices=["auto", "chunked", "fused"],
                        help="the classifier's path (auto: the fused Triton kernels on GPUs without CO2)"
                        + default_help("kernel"))
    parser.add_argument("--top-k", type=_at_least(0),
                        help="hard negatives per sample with top-K smoothing (0: none): the fused path's target rows"
                        + default_help("top_k"))
    parser.add_argument("--eval-images-per-second", type=_positive_float,
                        help="with --config: images one rank extracts features of per second, for the "
                        "evaluation's time (default 3,500: the GPU target for one 224 px view of docs/benchmarks.md; "
                        "`instcls bench eval` measures it)")
    parser.add_argument("--json", type=Path, help="also write the plan (bytes per term, per mode; every ZeRO stage's "
                        "total and the stage recommended) to this JSON file")
    parser.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from trainer.cli.plan_job_flags import config_overrides, fill_defaults
    from trainer.engine.deepspeed_setup import load_deepspeed_config
    from trainer.objectives import NoMemoryPlan
    from trainer.planning import GIB, PlanInput, deepspeed_settings, format_plan, plan_modes

    config = None
    if args.config is not None:
        from trainer.config import load_job_config
        from trainer.planning.plan_from_config import plan_input_from_config

        overrides = [*args.overrides, *config_overrides(args)]
        config = load_job_config(args.config, overrides)
        if overrides:
            print(f"config: {args.config} with " + " ".join(f"--set {override}" for override in overrides) + "\n")
        try:
            plan = plan_input_from_config(config, args.ranks, args.num_classes)
        except NoMemoryPlan as error:
            raise SystemExit(f"instcls plan: {error}") from None
    elif args.overrides:
        raise SystemExit("instcls plan: --set overrides a job config's values: give the config with --config FILE")
    elif args.num_classes is None:
        raise SystemExit("instcls plan: give --num-classes N, or --config FILE to plan the job a config describes")
    else:
        fill_defaults(args)
        from trainer.models.backbones import get_backbone

        takes_sizes = args.backbone != "none" and "img_size" in get_backbone(args.backbone).options
        plan = PlanInput(
            mode="dhp", num_classes=args.num_classes, ranks=args.ranks, batch=args.batch, dim=args.dim,
            chunk_size=args.chunk_size, logits_cache_bytes=int(args.logits_cache_gib * GIB), dtype=args.dtype,
            momentum=not args.no_momentum, update_in_backward=args.update_in_backward,
            optimizer=args.optimizer, activation_checkpointing=args.activation_checkpointing,
            backbone=None if args.backbone == "none" else args.backbone, image_size=args.image_size,
            img_size=args.image_size if takes_sizes else None, patch_size=args.patch_size,
            views=args.views, zero_stage=args.zero_stage, device="cpu" if args.cpu else "gpu", queue=args.queue,
            row_store=args.row_store, co2=args.co2, dali=not args.no_dali, kernel=args.kernel,
            targets=1 + args.top_k, checkpoints=True,
        )
    if config is None and args.deepspeed_config is not None:
        import ds_configs

        ds_file = ds_configs.resolve(args.deepspeed_config)  # a shipped name, or a path from here
        plan = replace(plan, **deepspeed_settings(load_deepspeed_config(ds_file, 1)))
    if plan.device == "cpu":
        from trainer.bench.runtime_baseline import runtime_rss_bytes

        plan = replace(plan, runtime_bytes=runtime_rss_bytes(plan.dali))
    capacity = int(args.gpu_memory_gib * GIB)
    print(format_plan(plan, capacity))
    if config is not None:  # the end-of-run evaluation at the job's N
        from trainer.planning.evaluation_plan import EXTRACTION_IMAGES_PER_SECOND, evaluation_plan_lines
        from trainer.planning.plan_from_config import num_instances_of

        try:
            bank_rows = num_instances_of(config, args.num_classes)
        except ValueError:  # N is not needed for the training plan of every objective
            print("evaluation: not planned (the training shards are not on this machine: give --num-classes N)")
        else:
            rate = args.eval_images_per_second or EXTRACTION_IMAGES_PER_SECOND
            print("\n".join(evaluation_plan_lines(config, args.ranks, bank_rows, rate)))
    if args.json:
        args.json.write_text(json.dumps(plan_modes(plan, capacity), indent=2))
    return 0
