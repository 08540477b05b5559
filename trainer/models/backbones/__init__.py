"""The backbone registry (``model.arch``), one file per family: ``registry.py`` says what an entry
gives; a family file registers its names when imported, below (one line per family)."""

from trainer.models.backbones import resnet, vit  # noqa: F401  (importing a family registers its names)
from trainer.models.backbones.registry import (
    FAMILY_OPTIONS,
    Backbone,
    Trunk,
    backbone_names,
    check_settings,
    get_backbone,
    register_backbone,
)

__all__ = ["FAMILY_OPTIONS", "Backbone", "Trunk", "backbone_names", "check_settings", "get_backbone",
           "register_backbone"]
