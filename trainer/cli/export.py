"""`instcls export`: a checkpoint's backbone as plain timm / torchvision weights with a model card."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer.cli.training import add_config_options

CONFIG_HELP = ("job config YAML; optional with --checkpoint DIR, whose run.json holds the run's resolved config "
               "(used when --config is not given). Given, it must build the checkpoint's network (a differing "
               "model.* architecture field is refused, naming it); its other values (paths, logging) win")


def register(commands) -> None:
    parser = commands.add_parser("export", help="a checkpoint's backbone as timm / torchvision weights (safetensors), "
                                 "config.json and a model card")
    add_config_options(parser, config_help=CONFIG_HELP)
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint directory, or 'auto' for the newest complete one in the --config's "
                        "checkpoint.dir")
    parser.add_argument("--out", type=Path, required=True, help="the export folder (created; must be empty)")
    parser.add_argument("--with-head", action="store_true",
                        help="also write the projection head (head.safetensors), described in config.json")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    parser.add_argument("--teacher", action="store_true",
                        help="export the momentum teacher (teacher/model.pt) instead of the trained network, for an "
                        "objective that keeps one (its own BatchNorm statistics included)")
    parser.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from trainer.export import export_checkpoint, library_network_of
    from trainer.provenance.checkpoint_config import checkpoint_and_config

    checkpoint, config = checkpoint_and_config(args.checkpoint, args.config, args.overrides)
    out = export_checkpoint(config, checkpoint, args.out, with_head=args.with_head, force=args.force,
                            teacher=args.teacher)
    constructor = library_network_of(config.model).code[0].splitlines()[0]
    network = "the momentum teacher's backbone" if args.teacher else "the backbone"
    print(f"exported {network} of {checkpoint} to {out} (model.safetensors, config.json, README.md)")
    print(f"load it as the model card shows, starting with: {constructor}")
    return 0
