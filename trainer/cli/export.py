"""`instcls export`: a checkpoint's backbone as plain timm / torchvision weights with a model card."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer.cli.training import add_config_options


def register(commands) -> None:
    parser = commands.add_parser("export", help="a checkpoint's backbone as timm / torchvision weights (safetensors), "
                                 "config.json and a model card")
    add_config_options(parser)
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint directory, or 'auto' for the newest complete one in checkpoint.dir")
    parser.add_argument("--out", type=Path, required=True, help="the export folder (created; must be empty)")
    parser.add_argument("--with-head", action="store_true",
                        help="also write the projection head (head.safetensors), described in config.json")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    parser.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from trainer.checkpoint.checkpoint_files import resolve_resume
    from trainer.config import load_job_config
    from trainer.export import export_checkpoint, library_network_of

    config = load_job_config(args.config, args.overrides)
    checkpoint = resolve_resume(args.checkpoint, config.checkpoint.dir)
    if checkpoint is None:
        raise FileNotFoundError(f"no complete checkpoint in {config.checkpoint.dir}: train first, or name one with "
                                "--checkpoint DIR")
    out = export_checkpoint(config, checkpoint, args.out, with_head=args.with_head, force=args.force)
    constructor = library_network_of(config.model).code[0].splitlines()[0]
    print(f"exported the backbone of {checkpoint} to {out} (model.safetensors, config.json, README.md)")
    print(f"load it as the model card shows, starting with: {constructor}")
    return 0
