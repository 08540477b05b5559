"""The backbone registry: ``model.arch`` names an entry, the entry builds the trunk.

A trunk maps images ``[b, 3, H, W]`` to features ``[b, width]`` and has no classification layer;
``trainer.models.backbone`` puts the MLP head on top of any of them.  Each family (ResNets,
ViTs, ...) is one file beside this one that calls ``register_backbone`` for its names; the
package's ``__init__`` imports each family file once (one line per family).

Some ``ModelConfig`` fields belong to one family only (``small_input_stem`` to ResNets, ``img_size``,
``patch_size`` and ``pool`` to ViTs).  An entry lists the ones it reads in ``options``; a config that sets
another family's field is refused naming the field, so a setting is never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from torch import nn

# ModelConfig fields that only some families read, with the value that means "not set".
FAMILY_OPTIONS = {"small_input_stem": False, "img_size": None, "patch_size": None, "pool": None}


class TrunkSettings(Protocol):
    """What a family reads of ``trainer.models.ModelConfig`` (the registry cannot import it: it
    validates itself against the registry)."""

    arch: str
    small_input_stem: bool
    img_size: int | None
    patch_size: int | None
    pool: str | None


@dataclass(frozen=True)
class Trunk:
    """A built trunk: ``module(images) -> [b, width]`` features, at random init."""

    module: nn.Module
    width: int


@dataclass(frozen=True)
class Backbone:
    """One registry entry.

    name: the ``model.arch`` value (for ViTs, timm's model name).
    family: the family file it comes from (``resnet``, ``vit``).
    build: ``build(settings) -> Trunk`` at random init; never downloads weights.  Works under
        ``torch.device("meta")`` (the planner and the tests count parameters there).
    options: the family-only ``ModelConfig`` fields it reads (keys of ``FAMILY_OPTIONS``).
    check: ``check(settings)`` raises ``ValueError`` naming the field and the fix for a value the
        family cannot build (called after the options check).
    blocks: ``blocks(trunk_module) -> [modules]``, the residual units in forward order: what
        activation checkpointing would wrap and what the memory profile measures one by one.
    """

    name: str
    family: str
    build: Callable[[TrunkSettings], Trunk]
    options: frozenset[str]
    check: Callable[[TrunkSettings], None]
    blocks: Callable[[nn.Module], Sequence[nn.Module]]


_BACKBONES: dict[str, Backbone] = {}


def register_backbone(backbone: Backbone) -> Backbone:
    unknown = backbone.options - FAMILY_OPTIONS.keys()
    if unknown:
        raise ValueError(f"backbone {backbone.name!r}: options {sorted(unknown)} are not ModelConfig fields of "
                         f"FAMILY_OPTIONS ({sorted(FAMILY_OPTIONS)}); add the field to ModelConfig and FAMILY_OPTIONS")
    if backbone.name in _BACKBONES:
        raise ValueError(f"backbone {backbone.name!r} is registered twice ({_BACKBONES[backbone.name].family} "
                         f"and {backbone.family}): give the second one another name")
    _BACKBONES[backbone.name] = backbone
    return backbone


def backbone_names() -> tuple[str, ...]:
    """Every ``model.arch`` value, in registration order (family by family, smallest first)."""
    return tuple(_BACKBONES)


def get_backbone(name: str) -> Backbone:
    if name not in _BACKBONES:
        raise ValueError(f"arch={name!r} is invalid: choose one of {', '.join(_BACKBONES)}")
    return _BACKBONES[name]


def check_settings(settings: TrunkSettings) -> Backbone:
    """The entry ``settings.arch`` names, after refusing any family-only field it does not read and
    any value its family cannot build.  Messages start with the field (``patch_size=4 is ...``)."""
    backbone = get_backbone(settings.arch)
    for field, unset in FAMILY_OPTIONS.items():
        value = getattr(settings, field)
        if field not in backbone.options and value != unset:
            readers = sorted({b.family for b in _BACKBONES.values() if field in b.options})
            raise ValueError(f"{field}={value!r} is invalid for {settings.arch} ({backbone.family}): only "
                             f"{' and '.join(readers)} backbones read it; remove it (default {unset!r})")
    backbone.check(settings)
    return backbone
