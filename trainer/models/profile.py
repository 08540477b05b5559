"""What the memory planner needs of a network, measured on the meta device (no memory, no compute):
its parameters and the bytes autograd saves for the backward, per image, in total and by residual
unit (the registry entry's ``blocks``), which is what activation checkpointing changes: with it,
a unit keeps only its input until the backward recomputes the unit.

Exact for the architecture and the image size, whatever the family: the same forward the trainer
runs, with every saved tensor counted once (``saved_tensors_hooks``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from trainer.models.backbone import ModelConfig, build_model
from trainer.models.backbones import get_backbone

PROFILE_BATCH = 2  # images in the meta forward: BatchNorm in train mode needs more than one


@dataclass(frozen=True)
class ModelProfile:
    """Per-image figures are fp32 bytes of a training-mode forward (scale by the element size for
    bf16).

    parameters: trunk and head.
    trunk_parameters: the trunk's alone.
    width: the trunk's feature width (the head's input).
    activation_bytes: everything saved for the backward, per image (trunk and head).
    blocks: the trunk's residual units.
    block_input_bytes: the units' inputs, summed, per image: what checkpointing every unit keeps.
    largest_block_bytes: the most one unit saves, per image: what the backward recomputes at once.
    outside_block_bytes: saved outside the units, per image (the stem, the final norm, the head).
    """

    parameters: int
    trunk_parameters: int
    width: int
    activation_bytes: int
    blocks: int
    block_input_bytes: int
    largest_block_bytes: int
    outside_block_bytes: int

    @property
    def checkpointed_activation_bytes(self) -> int:
        """Per image with every unit checkpointed: what is saved outside the units, each unit's input,
        and one unit's own saved tensors at a time during the backward."""
        return self.outside_block_bytes + self.block_input_bytes + self.largest_block_bytes


@lru_cache(maxsize=64)
def model_profile(config: ModelConfig, image_size: int) -> ModelProfile:
    # The network as it is, every unit's saved tensors counted where they are made, whether or not
    # the job checkpoints them (checkpointed_activation_bytes derives that case from these figures).
    config = replace(config, activation_checkpointing=False)
    with torch.device("meta"):
        model = build_model(config)
        images = torch.empty(PROFILE_BATCH, 3, image_size, image_size)
    units = list(get_backbone(config.arch).blocks(model.backbone))
    parameter_ids = {id(p) for p in model.parameters()}
    saved: dict[int, tuple[int, int | None]] = {}  # id -> (bytes, unit index or None)
    inputs = [0] * len(units)
    current: list[int | None] = [None]

    def enter(index):
        def hook(module, args):
            inputs[index] += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
            current[0] = index
        return hook

    def leave(module, args, output):
        current[0] = None

    def pack(tensor):
        base = tensor._base if tensor._base is not None else tensor
        if id(tensor) not in parameter_ids and id(base) not in parameter_ids:  # weights are not activations
            saved.setdefault(id(tensor), (tensor.numel() * tensor.element_size(), current[0]))
        return tensor

    handles = [h for i, unit in enumerate(units)
               for h in (unit.register_forward_pre_hook(enter(i)), unit.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = model.train()(images)
        del output
    finally:
        for handle in handles:
            handle.remove()
    per_unit = [0] * len(units)
    outside = 0
    for size, unit in saved.values():
        if unit is None:
            outside += size
        else:
            per_unit[unit] += size
    trunk_parameters = sum(p.numel() for p in model.backbone.parameters())
    return ModelProfile(
        parameters=sum(p.numel() for p in model.parameters()), trunk_parameters=trunk_parameters,
        width=model.backbone_width, activation_bytes=(outside + sum(per_unit)) // PROFILE_BATCH,
        blocks=len(units), block_input_bytes=sum(inputs) // PROFILE_BATCH,
        largest_block_bytes=max(per_unit, default=0) // PROFILE_BATCH,
        outside_block_bytes=outside // PROFILE_BATCH)
