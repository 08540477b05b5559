"""The optimizer registry: ``optim.name`` -> how to build it, what it reads, what state it keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from trainer.optim.param_groups import parameter_groups


@dataclass(frozen=True)
class OptimizerSettings:
    """The job's optimizer choice; the learning rate comes from the schedule.

    Attributes:
        name: a registered optimizer (``optimizer_names()``: sgd, lars, adamw).
        momentum: SGD's and LARS's momentum.
        weight_decay: of the decayed group (a weight-decay schedule may change it step by step).
        betas, eps: AdamW's moment decays and denominator guard; ``eps`` is also LARS's guard in
            its trust ratio.
        trust_coefficient: LARS's trust coefficient (0.001 in SwAV's code).
        exclude_from_decay: norms, biases, position embeddings and class tokens go to a group
            without weight decay and, under LARS, without the trust ratio (``param_groups.py``);
            None: the optimizer's default (``OptimizerSpec.excludes_by_default``).
    """

    name: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    trust_coefficient: float = 0.001
    exclude_from_decay: bool | None = None

    def excludes(self) -> bool:
        """Whether this job keeps norms, biases and tokens out of decay (and adaptation)."""
        if self.exclude_from_decay is not None:
            return self.exclude_from_decay
        return optimizer_spec(self.name).excludes_by_default


# (param groups, settings, initial learning rate, device of the parameters) -> the optimizer
Builder = Callable[[list[dict], OptimizerSettings, float, torch.device], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerSpec:
    """A registered optimizer.

    Attributes:
        name: its ``optim.name``.
        build: makes it from param groups (``param_groups.parameter_groups``).
        state_bytes_per_parameter: fp32 optimizer state it keeps per parameter (SGD's and LARS's
            momentum 4, AdamW's two moments 8), for the memory planner.
        excludes_by_default: what ``optim.exclude_from_decay`` is when the config leaves it out:
            the convention of the recipes that use this optimizer.
        reads: the settings it uses besides ``weight_decay`` (a config that sets another
            optimizer's field away from its default is refused).
    """

    name: str
    build: Builder
    state_bytes_per_parameter: int
    excludes_by_default: bool
    reads: frozenset[str]


OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec) -> None:
    if spec.name in OPTIMIZERS and OPTIMIZERS[spec.name] is not spec:
        raise ValueError(f"an optimizer named {spec.name!r} is already registered")
    OPTIMIZERS[spec.name] = spec


def unregister_optimizer(name: str) -> None:
    OPTIMIZERS.pop(name, None)


def optimizer_names() -> list[str]:
    return sorted(OPTIMIZERS)


def optimizer_spec(name: str) -> OptimizerSpec:
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is not a registered optimizer: choose one of "
                         f"{', '.join(optimizer_names())}")
    return OPTIMIZERS[name]


def build_optimizer(settings: OptimizerSettings, model: nn.Module, lr: float,
                    device: torch.device | str | None = None) -> torch.optim.Optimizer:
    """The optimizer ``settings`` names over ``model``'s trainable parameters, in the groups
    ``exclude_from_decay`` decides; ``device`` (default: the parameters') picks its kernels."""
    spec = optimizer_spec(settings.name)
    groups = parameter_groups(model, settings.weight_decay, settings.excludes())
    if not groups:
        raise ValueError("the model has no trainable parameters to optimize")
    if device is None:
        device = groups[0]["params"][0].device
    return spec.build(groups, settings, lr, torch.device(device))
