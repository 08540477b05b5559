"""The backbone registry: ``model.arch`` names an entry, the entry builds the trunk.

A trunk maps images ``[b, 3, H, W]`` to features ``[b, width]`` and has no classification layer;
``trainer.models.backbone`` puts the MLP head on top of any of them.  Each family (ResNets,
ViTs, ...) is one file beside this one that calls ``register_backbone`` for its names; the
package's ``__init__`` imports each family file once (one line per family).

Some ``ModelConfig`` fields belong to one family only (``small_input_stem`` to ResNets, ``img_size``,
``patch_size`` and ``pool`` to ViTs).  An entry lists the ones it reads in ``options``; a config that sets
another family's field is refused naming the field, so a setting is never silently ignored.

An entry's ``export`` says how the library alone (timm, torchvision) builds the same network, so that
``instcls export`` hands out weights that load into it with ``strict=True`` and no instcls installed.
"""

from __future__ import annotations

import dataclasses
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
class LibraryNetwork:
    """An entry's trunk as its library builds it, without instcls: the trunk's state dict with
    ``backbone.`` stripped loads into it with ``strict=True`` (same names, same shapes).

    library: "timm" or "torchvision".
    architecture: the library's name for it (timm's model name; torchvision's function name, or
        ``resnet10``, which torchvision builds from its ``ResNet`` class).
    imports: the import lines ``code`` needs (torch and the library only).
    code: plain Python lines that bind ``network`` to the trunk at random init, never downloading:
        the constructor with every argument that changes a shape or a key, then any module swaps
        (a ResNet's small stem, its ``fc`` dropped).  The export's model card prints them as they are.
    model_args: timm's ``create_model`` keyword arguments (its hub config's ``model_args``); {} for
        torchvision.
    """

    library: str
    architecture: str
    imports: tuple[str, ...]
    code: tuple[str, ...]
    model_args: dict = dataclasses.field(default_factory=dict, hash=False)

    def build(self) -> nn.Module:
        """The network at random init, by running ``code`` itself: what the model card prints is
        what the tests load.  Under ``torch.device("meta")`` nothing is allocated."""
        namespace: dict = {}
        exec("\n".join((*self.imports, *self.code)), namespace)  # our own lines, from the entry
        return namespace["network"]


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
    export: ``export(settings) -> LibraryNetwork``, the same trunk as timm or torchvision builds it
        (``instcls export``); None: the entry cannot be exported, and an export of it is refused.
    """

    name: str
    family: str
    build: Callable[[TrunkSettings], Trunk]
    options: frozenset[str]
    check: Callable[[TrunkSettings], None]
    blocks: Callable[[nn.Module], Sequence[nn.Module]]
    export: Callable[[TrunkSettings], LibraryNetwork] | None = None


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
