"""`instcls plan`: predicted per-GPU memory of a job for DDP, DHP and PIC, and the largest N."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands) -> None:
    from trainer.bench.step_runner import FLOAT_DTYPES

    parser = commands.add_parser("plan", help="predict per-GPU memory of a job for DDP, DHP and PIC, and the largest N")
    parser.add_argument("--num-classes", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True, help="GPUs (T)")
    parser.add_argument("--batch", type=int, default=4096, help="global images per step")
    parser.add_argument("--views", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=65536)
    parser.add_argument("--logits-cache-gib", type=float, default=0.0,
                        help="classifier.logits_cache_bytes in GiB: keep the logits for the backward if they fit")
    parser.add_argument("--dtype", default="float32", choices=FLOAT_DTYPES)
    parser.add_argument("--backbone", choices=["resnet18", "resnet34", "resnet50", "resnet101"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--deepspeed-config", type=Path,
                        help="read the ZeRO stage, its bucket sizes and bf16 from this file (ds_configs/*.json)")
    parser.add_argument("--no-dali", action="store_true", help="the loader decodes on the CPU (no DALI buffers)")
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
    from dataclasses import replace

    from trainer.bench.planner import GIB, PlanInput, deepspeed_settings, format_plan
    from trainer.engine.deepspeed_setup import load_deepspeed_config

    plan = PlanInput(
        mode="dhp", num_classes=args.num_classes, ranks=args.ranks, batch=args.batch, dim=args.dim,
        chunk_size=args.chunk_size, logits_cache_bytes=int(args.logits_cache_gib * GIB), dtype=args.dtype,
        momentum=not args.no_momentum,
        update_in_backward=args.update_in_backward, backbone=args.backbone, image_size=args.image_size,
        views=args.views, zero_stage=args.zero_stage, device="cpu" if args.cpu else "gpu", queue=args.queue,
        row_store=args.row_store, co2=args.co2, dali=not args.no_dali,
    )
    if args.deepspeed_config is not None:
        plan = replace(plan, **deepspeed_settings(load_deepspeed_config(args.deepspeed_config, 1)))
    print(format_plan(plan, int(args.gpu_memory_gib * GIB)))
    return 0
