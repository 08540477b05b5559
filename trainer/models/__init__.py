"""Backbone + projection head. Nothing here touches torch.distributed."""

from trainer.models.backbone import ModelConfig, build_model

__all__ = ["ModelConfig", "build_model"]
