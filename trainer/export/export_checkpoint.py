"""``export_checkpoint``: a checkpoint's backbone out as a folder that timm or torchvision loads alone.

The folder is written whole beside its final place and renamed into it, so it either holds a complete
export or does not exist (an interrupted export leaves a ``.OUT.tmp-PID`` folder, never half an export).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from trainer.models.backbones.registry import LibraryNetwork


def library_network_of(model_config) -> LibraryNetwork:
    """The registry entry's export mapping for ``model_config``; ``ValueError`` when it has none."""
    from trainer.models.backbones import get_backbone

    backbone = get_backbone(model_config.arch)
    if backbone.export is None:
        raise ValueError(f"model.arch={model_config.arch!r} ({backbone.family}) has no export mapping: give its "
                         "registry entry an `export` (trainer/models/backbones/registry.py, LibraryNetwork) saying "
                         "how timm or torchvision builds the same network")
    return backbone.export(model_config)


def _refuse_nonempty(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file: name a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ValueError(f"--out {out_dir} is not empty: name another folder, or add --force to replace it")


def _replace_folder(tmp: Path, out_dir: Path) -> None:
    """``tmp`` becomes ``out_dir``; an existing one is moved aside first and deleted after."""
    aside = None
    if out_dir.exists():
        aside = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, aside)
    os.replace(tmp, out_dir)
    if aside is not None:
        shutil.rmtree(aside)


def _run_config(provenance: dict | None, config):
    """The run's own resolved config from its ``run.json``, or ``config`` when there is none or it no
    longer loads (a field renamed since)."""
    if not provenance or not provenance.get("config"):
        return config
    from trainer.provenance.checkpoint_config import recorded_config

    try:
        return recorded_config(provenance)
    except (ValueError, TypeError):
        return config


def export_checkpoint(config, checkpoint_dir: Path, out_dir: Path, with_head: bool = False,
                      force: bool = False, teacher: bool = False) -> Path:
    """Write ``out_dir`` with ``model.safetensors`` (the backbone of ``checkpoint_dir``'s ``model.pt``
    under the library network's names), ``config.json``, ``README.md`` (the model card), ``run.json``
    when the checkpoint has one, and with ``with_head`` ``head.safetensors``.  Returns ``out_dir``.
    ``teacher``: the momentum teacher's network (``teacher/model.pt``, with its own BatchNorm
    statistics) instead of the student's; ``config.json`` records which (``instcls.checkpoint.network``).

    Refused with ``ValueError`` naming the fix: an entry without an export mapping, a non-empty
    ``out_dir`` (unless ``force``), a checkpoint of another job's network, a backbone whose names or
    shapes differ from the library network's."""
    from safetensors.torch import save_file

    from trainer.checkpoint.checkpoint_files import MODEL_FILE, load_model_weights, read_trainer_meta
    from trainer.checkpoint.run_fingerprint import refuse_another_jobs_checkpoint, run_fingerprint
    from trainer.checkpoint.teacher_state import load_teacher_weights
    from trainer.export.export_config import export_config, head_description, input_spec
    from trainer.export.model_card import checkpoint_scores, model_card, training_data
    from trainer.export.snippet import head_snippet, usage_snippet
    from trainer.export.weights import head_state_dict, library_state_dict
    from trainer.models import build_model
    from trainer.provenance import RUN_FILE, read_provenance

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    library = library_network_of(config.model)
    _refuse_nonempty(out_dir, force)
    if not (checkpoint_dir / MODEL_FILE).is_file():
        raise FileNotFoundError(f"{checkpoint_dir / MODEL_FILE} not found: name a complete checkpoint "
                                "(checkpoint.dir/step_NNNNNNNNN) or use --checkpoint auto")
    refuse_another_jobs_checkpoint(checkpoint_dir, run_fingerprint(config, num_instances=0), model_only=True)
    state = load_teacher_weights(checkpoint_dir) if teacher else load_model_weights(checkpoint_dir)
    weights = library_state_dict(state, library, config.model.arch)
    with torch.device("meta"):  # names, shapes and widths only
        model = build_model(config.model)
    head = head_state_dict(state, model.head) if with_head else None

    meta = read_trainer_meta(checkpoint_dir)
    step = meta.get("global_step")
    provenance = read_provenance(checkpoint_dir)
    spec = input_spec(config)
    exported = export_config(config, library, model.backbone_width, with_head=with_head, checkpoint={
        "path": str(checkpoint_dir.resolve()), "global_step": step, "epoch": meta.get("epoch"),
        "network": "teacher" if teacher else "student"})
    snippet = usage_snippet(library, spec, config.model.input_norm, model.backbone_width)
    head_code = head_snippet(head_description(config.model, model.backbone_width)) if with_head else None
    # the card describes the run (its epochs and objective settings), not the file given to export
    card = model_card(_run_config(provenance, config), exported, snippet, meta,
                      checkpoint_scores(config.logging.dir, step), provenance,
                      training_data(config, provenance), spec, out_dir, head=head_code)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if head is not None:
            save_file(head, str(tmp / "head.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(exported, indent=2) + "\n")
        (tmp / "README.md").write_text(card)
        if provenance is not None:
            shutil.copyfile(checkpoint_dir / RUN_FILE, tmp / RUN_FILE)
        _refuse_nonempty(out_dir, force)  # another export may have filled it meanwhile
        _replace_folder(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
