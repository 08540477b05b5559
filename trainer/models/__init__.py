"""Backbone + projection head. Nothing here touches torch.distributed."""

from trainer.models.backbone import ModelConfig, build_model
from trainer.models.backbones import backbone_names

__all__ = ["ModelConfig", "backbone_names", "build_model"]
