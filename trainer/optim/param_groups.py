"""Which parameters decay (and, under LARS, adapt): the optimizer's parameter groups.

With ``exclude_from_decay`` the parameters of the SimCLR / BYOL / timm convention go to a second
group, without weight decay and (under LARS) without the trust ratio:

- every parameter of a normalisation layer (BatchNorm, LayerNorm, GroupNorm, InstanceNorm,
  RMSNorm) and every bias: in practice every parameter of one dimension or none;
- position embeddings and class tokens: what a module's ``no_weight_decay()`` names (timm's ViTs
  name ``pos_embed``, ``cls_token``, ``dist_token``), and parameters named like them (torchvision's
  ``pos_embedding``, ``class_token``).

Without it there is one group, all parameters decayed and adapted (SwAV's code: LARC over all
parameters).  Frozen parameters (``requires_grad`` False) are in no group; empty groups are left
out (DeepSpeed flattens each group and cannot flatten none).
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm)
TOKEN_NAMES = ("pos_embed", "pos_embedding", "position_embeddings", "cls_token", "class_token", "dist_token",
               "reg_token")


def _names_declared_without_decay(model: nn.Module) -> set[str]:
    """Full names of what the modules' own ``no_weight_decay()`` declares (timm's convention)."""
    names = set()
    for prefix, module in model.named_modules():
        declared = getattr(module, "no_weight_decay", None)
        if callable(declared):
            names.update(f"{prefix}.{name}" if prefix else name for name in declared())
    return names


def excluded_from_decay(model: nn.Module) -> set[str]:
    """Names of ``model``'s parameters the convention keeps out of weight decay and adaptation."""
    declared = _names_declared_without_decay(model)
    excluded = set()
    for prefix, module in model.named_modules():
        for local, parameter in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            if (isinstance(module, NORM_LAYERS) or parameter.ndim <= 1 or local == "bias" or name in declared
                    or local in TOKEN_NAMES):
                excluded.add(name)
    return excluded


def parameter_groups(model: nn.Module, weight_decay: float, exclude_from_decay: bool) -> list[dict]:
    """The param groups of ``model``'s trainable parameters: ``{"params", "weight_decay", "decay",
    "adapt"}`` dicts; ``decay`` marks the group a weight-decay schedule sets, ``adapt`` the group
    LARS scales by its trust ratio."""
    excluded = excluded_from_decay(model) if exclude_from_decay else set()
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decayed = [p for name, p in trainable if name not in excluded]
    kept = [p for name, p in trainable if name in excluded]
    groups = [{"params": decayed, "weight_decay": weight_decay, "decay": True, "adapt": True},
              {"params": kept, "weight_decay": 0.0, "decay": False, "adapt": False}]
    return [group for group in groups if group["params"]]


def group_of(groups: Iterable[dict], parameter: nn.Parameter) -> dict:
    """The group holding ``parameter`` (by identity)."""
    for group in groups:
        if any(p is parameter for p in group["params"]):
            return group
    raise KeyError("the parameter is in no group")
