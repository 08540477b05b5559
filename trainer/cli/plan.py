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
    from trainer.bench.step_runner import FLOAT_DTYPES
    from trainer.models import backbone_names
    from trainer.optim import optimizer_names

    parser = commands.add_parser("plan", help="predict per-GPU memory of a job (its objective's, or DDP, DHP and PIC), "
                                              "the largest N, and the ZeRO stage to run")
    parser.add_argument("--config", type=Path,
                        help="plan the job this config describes (backbone, batch per rank, views, D, objective, "
                             "DeepSpeed config, loader); N from its training shards unless --num-classes is given")
    parser.add_argument("--num-classes", type=_at_least(1), help="N (required without --config)")
    parser.add_argument("--ranks", type=_at_least(1), required=True, help="GPUs (T)")
    parser.add_argument("--batch", type=_at_least(1), default=4096, help="global images per step")
    parser.add_argument("--views", type=_at_least(1), default=2)
    parser.add_argument("--dim", type=_at_least(1), default=128)
    parser.add_argument("--chunk-size", type=_at_least(1), default=65536)
    parser.add_argument("--logits-cache-gib", type=_at_least(0.0, float), default=0.0,
                        help="classifier.logits_cache_bytes in GiB: keep the logits for the backward if they fit")
    parser.add_argument("--dtype", default="float32", choices=FLOAT_DTYPES)
    parser.add_argument("--backbone", default="resnet50", choices=[*backbone_names(), "none"],
                        help="counted by default; 'none' plans the classifier alone")
    parser.add_argument("--image-size", type=_at_least(1), default=224)
    parser.add_argument("--patch-size", type=_at_least(1),
                        help="ViTs: model.patch_size (default: the name's); the ViT is laid out for --image-size")
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3],
                        help="the stage the breakdown is printed at (every stage is planned, the lowest that fits "
                        "is recommended)")
    parser.add_argument("--optimizer", choices=optimizer_names(),
                        help="the backbone's optimizer, whose state per parameter is planned (default: the config's "
                        "optim.name, else sgd)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="each residual unit keeps only its input, recomputed in the backward (with --config: "
                        "as if model.activation_checkpointing were true)")
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
    parser.add_argument("--queue", type=_at_least(0), default=65536, help="PIC: K recent ids scored besides the batch")
    parser.add_argument("--row-store", default="host", choices=["device", "host", "disk"],
                        help="PIC: where W and its momentum live (device counts them in device memory)")
    parser.add_argument("--co2", action="store_true", help="add CO2's consistency term (co2_alpha > 0)")
    parser.add_argument("--kernel", default="auto", choices=["auto", "chunked", "fused"],
                        help="the classifier's path (auto: the fused Triton kernels on GPUs without CO2)")
    parser.add_argument("--top-k", type=_at_least(0), default=0,
                        help="hard negatives per sample with top-K smoothing (0: none): the fused path's target rows")
    parser.add_argument("--json", type=Path, help="also write the plan (bytes per term, per mode; every ZeRO stage's "
                        "total and the stage recommended) to this JSON file")
    parser.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from trainer.engine.deepspeed_setup import load_deepspeed_config
    from trainer.objectives import NoMemoryPlan
    from trainer.planning import GIB, PlanInput, deepspeed_settings, format_plan, plan_modes

    if args.config is not None:
        from trainer.config import load_job_config
        from trainer.planning.plan_from_config import plan_input_from_config

        try:
            plan = plan_input_from_config(load_job_config(args.config, []), args.ranks, args.num_classes)
        except NoMemoryPlan as error:
            raise SystemExit(f"instcls plan: {error}") from None
        if args.cpu:
            plan = replace(plan, device="cpu")
        if args.optimizer is not None:
            plan = replace(plan, optimizer=args.optimizer)
        if args.activation_checkpointing:
            plan = replace(plan, activation_checkpointing=True)
    elif args.num_classes is None:
        raise SystemExit("instcls plan: give --num-classes N, or --config FILE to plan the job a config describes")
    else:
        from trainer.models.backbones import get_backbone

        takes_sizes = args.backbone != "none" and "img_size" in get_backbone(args.backbone).options
        plan = PlanInput(
            mode="dhp", num_classes=args.num_classes, ranks=args.ranks, batch=args.batch, dim=args.dim,
            chunk_size=args.chunk_size, logits_cache_bytes=int(args.logits_cache_gib * GIB), dtype=args.dtype,
            momentum=not args.no_momentum, update_in_backward=args.update_in_backward,
            optimizer=args.optimizer or "sgd", activation_checkpointing=args.activation_checkpointing,
            backbone=None if args.backbone == "none" else args.backbone, image_size=args.image_size,
            img_size=args.image_size if takes_sizes else None, patch_size=args.patch_size,
            views=args.views, zero_stage=args.zero_stage, device="cpu" if args.cpu else "gpu", queue=args.queue,
            row_store=args.row_store, co2=args.co2, dali=not args.no_dali, kernel=args.kernel,
            targets=1 + args.top_k, checkpoints=True,
        )
    if args.deepspeed_config is not None:
        import ds_configs

        ds_file = ds_configs.resolve(args.deepspeed_config)  # a shipped name, or a path from here
        plan = replace(plan, **deepspeed_settings(load_deepspeed_config(ds_file, 1)))
    if plan.device == "cpu":
        from trainer.bench.runtime_baseline import runtime_rss_bytes

        plan = replace(plan, runtime_bytes=runtime_rss_bytes(plan.dali))
    capacity = int(args.gpu_memory_gib * GIB)
    print(format_plan(plan, capacity))
    if args.config is not None:  # the end-of-run evaluation at the job's N
        from trainer.config import load_job_config
        from trainer.planning.evaluation_plan import evaluation_plan_lines
        from trainer.planning.plan_from_config import num_instances_of

        config = load_job_config(args.config, [])
        try:
            bank_rows = num_instances_of(config, args.num_classes)
        except ValueError:  # N is not needed for the training plan of every objective
            print("evaluation: not planned (the training shards are not on this machine: give --num-classes N)")
        else:
            print("\n".join(evaluation_plan_lines(config, args.ranks, bank_rows)))
    if args.json:
        args.json.write_text(json.dumps(plan_modes(plan, capacity), indent=2))
    return 0
