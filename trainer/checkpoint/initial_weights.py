"""``model.init_from``: a run's backbone started from weights instead of random init.

The file can be any of the forms a backbone travels in:
- an ``instcls export`` (its folder, or the ``model.safetensors`` in it): the library network's keys;
- a plain timm or torchvision state dict, ``.pth``/``.pt`` (read with ``weights_only``) or
  ``.safetensors``, possibly wrapped the usual ways (``{"state_dict": ...}``, ``{"model": ...}``,
  a ``module.`` prefix from DDP);
- another instcls run's checkpoint folder (its ``model.pt``, keys ``backbone.*`` and ``head.*``);
- a self-supervised method's checkpoint that holds a student and a teacher: MoCo v2's, DINO's full
  checkpoint, a BYOL learner's of lucidrains/byol-pytorch (``model.init_from_part`` picks the
  network; ``trainer.checkpoint.weight_layouts`` says each layout and its rule).

The trunks of the registry are those libraries' networks without their classifier, so the keys
match once a file's classifier (``fc.*`` of torchvision, ``head.*`` of timm, instcls's projection
``head.*``) is dropped; what is dropped is listed.  Everything else is strict unless
``model.init_strict: false``; a tensor of another shape is refused either way, naming the first one
(another architecture, patch size or image size).  A file none of whose tensors is the backbone's
under any known layout is refused, naming the layouts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trainer.checkpoint.safe_load import UnsafeCheckpointError, load_data
from trainer.checkpoint.weight_layouts import KNOWN_LAYOUTS, Selection, select_backbone

CLASSIFIER_PREFIXES = ("fc.", "head.")  # torchvision's and timm's classifier, instcls's projection head
_CHECKPOINT_MODEL = "model.pt"
_EXPORT_WEIGHTS = "model.safetensors"
# DINO's checkpoint.pth keeps its command line as an argparse.Namespace of plain values: a plain
# attribute holder, allowed by name so that the file reads with weights_only.
_PLAIN_OBJECTS = [argparse.Namespace]


@dataclass
class LoadedWeights:
    """What ``load_initial_weights`` did, for the log: the file read, the layout's rule and the keys
    left out."""

    file: Path
    loaded: int
    rule: str = ""  # the layout recognised and the prefix stripped
    set_aside: dict[str, int] = field(default_factory=dict)  # the file's keys of other networks, per group
    dropped: list[str] = field(default_factory=list)  # the file's classifier keys
    missing: list[str] = field(default_factory=list)  # backbone tensors the file lacks (init_strict: false)
    unexpected: list[str] = field(default_factory=list)  # the file's tensors the backbone lacks (idem)

    def describe(self) -> str:
        parts = [f"model.init_from: {self.loaded} backbone tensors from {self.file}", f"layout: {self.rule}"]
        if self.set_aside:
            groups = ", ".join(f"{group} ({count})" for group, count in self.set_aside.items())
            parts.append(f"other keys dropped ({sum(self.set_aside.values())}): {groups}")
        for label, keys in (("classifier keys dropped", self.dropped), ("missing, left at random init", self.missing),
                            ("unexpected, ignored", self.unexpected)):
            if keys:
                parts.append(f"{label} ({len(keys)}): {', '.join(keys)}")
        return "; ".join(parts)


def weights_file(path: Path) -> Path:
    """The file ``init_from`` names: itself, an export folder's ``model.safetensors`` or a checkpoint
    folder's ``model.pt``."""
    path = Path(path)
    if path.is_dir():
        for name in (_EXPORT_WEIGHTS, _CHECKPOINT_MODEL):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"model.init_from={path} is a folder with neither {_EXPORT_WEIGHTS} (an instcls "
                                f"export) nor {_CHECKPOINT_MODEL} (a complete checkpoint): point it at one of those, "
                                "or at a .pth/.safetensors state dict")
    if not path.is_file():
        raise FileNotFoundError(f"model.init_from={path} does not exist: point it at an export, a checkpoint folder "
                                "or a timm/torchvision state dict (.pth or .safetensors)")
    return path


def _read(file: Path):
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file), device="cpu")
        with torch.serialization.safe_globals(_PLAIN_OBJECTS):
            return load_data(file, map_location="cpu")
    except UnsafeCheckpointError:
        raise ValueError(f"model.init_from={file} is unreadable as plain tensors: it is not a torch file, or it "
                         "pickles objects, which could run code and are never loaded; save the network's "
                         "state_dict() with torch.save or safetensors") from None
    except Exception as error:  # noqa: BLE001 - any reader's failure is the same user error: an unreadable file
        raise ValueError(f"model.init_from={file} is unreadable ({type(error).__name__}: {error}); give a state "
                         "dict saved with torch.save or safetensors") from None


def read_backbone_weights(path: Path, part: str | None = None) -> tuple[Path, Selection]:
    """``(file, selection)``: the file ``path`` names and its backbone's tensors under the library
    network's keys (classifier keys still in), found by its layout's rule; ``part`` picks the
    student or the teacher of a file that holds both (None: the layout's default)."""
    file = weights_file(path)
    return file, select_backbone(_read(file), file, part)


def load_initial_weights(backbone: nn.Module, path: Path, strict: bool = True,
                         part: str | None = None) -> LoadedWeights:
    """Copy ``path``'s weights into ``backbone`` (the trunk, in place); raise ``ValueError`` naming the
    key for another architecture, and, when ``strict``, for any missing or unexpected tensor; naming
    the known layouts for a file none of whose tensors is the backbone's."""
    file, selection = read_backbone_weights(path, part)
    tensors = selection.tensors
    expected = backbone.state_dict()
    dropped = sorted(key for key in tensors if key not in expected and key.startswith(CLASSIFIER_PREFIXES))
    tensors = {key: value for key, value in tensors.items() if key not in dropped}
    if not any(key in expected for key in tensors):
        first = ", ".join(sorted(selection.tensors)[:4]) or "none"
        raise ValueError(f"model.init_from={file} is a layout init_from does not know: none of its tensors is one of "
                         f"model.arch's backbone (read as {selection.rule}; its first keys: {first}). Known "
                         f"layouts: {KNOWN_LAYOUTS}. Save the backbone in one of them, or check model.arch")
    for key, value in tensors.items():
        if key in expected and tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(f"model.init_from={file} is another architecture: {key} has shape "
                             f"{tuple(value.shape)} there and {tuple(expected[key].shape)} in model.arch's backbone "
                             "(check model.arch, patch_size, img_size, small_input_stem and pool)")
    missing = sorted(key for key in expected if key not in tensors)
    unexpected = sorted(key for key in tensors if key not in expected)
    if strict and (missing or unexpected):
        found = "; ".join(f"{label} {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
                          for label, keys in (("missing:", missing), ("unexpected:", unexpected)) if keys)
        raise ValueError(f"model.init_from={file} does not fit model.arch's backbone ({found}); use the file of "
                         "the same architecture, or set model.init_strict: false to load what matches")
    with torch.no_grad():
        for key, value in tensors.items():
            if key in expected:
                expected[key].copy_(value.to(expected[key].dtype))
    return LoadedWeights(file, len(tensors) - len(unexpected), selection.rule, selection.set_aside, dropped, missing,
                         unexpected)


def starting_network(config, say=print, resumed: Path | None = None) -> nn.Module:
    """The network a run of job ``config`` starts from: its random init drawn from ``config.seed``,
    the same on every rank, with ``model.init_from``'s backbone loaded over it when set (``say``
    gets what was loaded and left out).  Training and `instcls eval --checkpoint random-init` both
    start here, so the baseline a run is scored against is the network it started from.  A run
    that ``resumed`` a checkpoint takes its weights from there: ``init_from`` is not read (said)."""
    from trainer.checkpoint.rng_state import reseed
    from trainer.models.backbone import build_model

    reseed(config.seed, 0, 0)
    model = build_model(config.model)
    if config.model.init_from is not None and resumed is not None:
        say(f"model.init_from={config.model.init_from} is ignored: the run resumes from {resumed}, whose weights win")
    elif config.model.init_from is not None:
        say(load_initial_weights(model.backbone, config.model.init_from, config.model.init_strict,
                                 config.model.init_from_part).describe())
    return model
