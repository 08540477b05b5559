"""``instcls export``: a checkpoint's backbone as plain timm / torchvision weights (``model.safetensors``),
with timm's hub ``config.json`` and a model card whose Python snippet loads them without instcls."""

from trainer.export.export_checkpoint import export_checkpoint, library_network_of
from trainer.export.export_config import InputSpec, export_config, input_spec
from trainer.export.model_card import checkpoint_scores, model_card
from trainer.export.snippet import head_snippet, usage_snippet
from trainer.export.weights import head_state_dict, library_state_dict

__all__ = ["InputSpec", "checkpoint_scores", "export_checkpoint", "export_config", "head_snippet", "head_state_dict",
           "input_spec", "library_network_of", "library_state_dict", "model_card", "usage_snippet"]
