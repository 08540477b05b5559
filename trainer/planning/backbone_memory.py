"""Memory of the backbone (trunk and MLP head) per rank under DeepSpeed ZeRO.

Weights and gradients in the job's dtype (gradients in fp32 when the bf16 config reduces in fp32;
weights and gradients in fp32 when bf16 runs under ``torch.autocast``), the optimizer's state
(``OptimizerSpec.state_bytes_per_parameter``: SGD's and LARS's momentum 4, AdamW's two moments 8)
plus the fp32 master copy under a bf16 engine (none under autocast: the weights are the masters),
partitioned over the ranks by ZeRO: stage >= 1 the optimizer state, >= 2 the gradients, 3 the
weights.  Activations are the bytes autograd saves for the backward, per image in the job's dtype,
measured by one forward on the meta device (``trainer.models.profile``: exact for the architecture
and image size, no compute); with activation checkpointing, what every residual unit's input and
one unit's recomputation keep.

An objective's momentum teacher (``PlanInput.teacher``) is an fp32 copy of the whole network on every
rank at ZeRO 0 to 2 (the stages that keep one, ``trainer.engine.teacher_setup``), whatever the
job's dtype; its forward runs without gradient, so it saves no activations for the backward.
"""

from __future__ import annotations

from trainer.models import ModelConfig
from trainer.models.profile import ModelProfile, model_profile
from trainer.planning.plan_input import PlanInput, element_size, optimizer_state_bytes


def backbone_profile(plan: PlanInput, side: int | None = None) -> ModelProfile:
    """The network's parameters and saved activations per image (fp32) of ``side`` pixels (default: the
    plan's image size), lru-cached per shape."""
    return model_profile(ModelConfig(arch=plan.backbone, head_hidden_dim=plan.head_hidden_dim, feature_dim=plan.dim,
                                     img_size=plan.img_size, patch_size=plan.patch_size), side or plan.image_size)


def optimizer_state_per_parameter(plan: PlanInput) -> int:
    """The optimizer's fp32 state, plus the fp32 master weights DeepSpeed keeps under bf16/fp16."""
    return optimizer_state_bytes(plan) + (4 if plan.dtype != "float32" and not plan.fp32_weights else 0)


def activation_bytes_per_sample(plan: PlanInput) -> int:
    """Saved for the backward per sample (every view at its side) in the job's dtype, with or without
    activation checkpointing."""
    fp32 = 0
    for side in plan.sides:
        profile = backbone_profile(plan, side)
        fp32 += profile.checkpointed_activation_bytes if plan.activation_checkpointing else profile.activation_bytes
    return fp32 * element_size(plan.dtype) // 4


def backbone_breakdown(plan: PlanInput) -> dict[str, int]:
    if plan.backbone is None:
        return {}
    parameters = backbone_profile(plan).parameters
    half = plan.dtype != "float32" and not plan.fp32_weights
    stage, ranks = plan.zero_stage, plan.ranks
    weights = parameters * (2 if half else 4) / (ranks if stage >= 3 else 1)
    gradients = parameters * (2 if half and not plan.fp32_gradients else 4) / (ranks if stage >= 2 else 1)
    optimizer_state = parameters * optimizer_state_per_parameter(plan) / (ranks if stage >= 1 else 1)
    breakdown = {
        "backbone weights": int(weights),
        "backbone gradients": int(gradients),
        "backbone optimizer state": int(optimizer_state),
        "backbone activations": activation_bytes_per_sample(plan) * (plan.batch // ranks),
    }
    if plan.teacher:
        breakdown["momentum teacher (fp32 copy)"] = parameters * 4
    return breakdown
