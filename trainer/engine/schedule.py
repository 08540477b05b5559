"""Linear warm-up then cosine decay, one shape for the DeepSpeed backbone optimizer and the
classifier's own SGD so both move in step: the same schedule, or (``optim.objective_base_lr``) the
same warm-up and cosine at the objective's own peak."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    peak_lr: float
    warmup_steps: int
    total_steps: int
    min_lr: float = 0.0

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def scaled_lr(base_lr: float, base_batch: int, global_batch: int) -> float:
    """The linear scaling rule: ``base_lr`` was tuned for ``base_batch`` images per step."""
    return base_lr * global_batch / base_batch


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@dataclass(frozen=True)
class WeightDecaySchedule:
    """``optim.weight_decay_end``: cosine from ``start`` at step 0 to ``end`` at the last step
    (DINO's ViT recipe), with no warm-up."""

    start: float
    end: float
    total_steps: int

    def value_at(self, step: int) -> float:
        progress = min(1.0, step / max(1, self.total_steps - 1))
        return self.end + (self.start - self.end) * 0.5 * (1 + math.cos(math.pi * progress))


def set_weight_decay(optimizer, weight_decay: float) -> None:
    """Sets the weight decay of the groups ``trainer.optim`` marks ``decay``; the no-decay group,
    and optimizers without the mark (the objectives' own SGD), keep theirs."""
    for group in optimizer.param_groups:
        if group.get("decay", False):
            group["weight_decay"] = weight_decay


@dataclass(frozen=True)
class StepSchedules:
    """What the trainer sets on every optimizer before each step.

    backbone: the learning rate of the backbone's optimizer (``optim.base_lr``), and of those of the
        objective's optimizers that are the backbone's kind (``Objective.backbone_lr_optimizers``:
        SwAV's prototypes, stepped as its code steps them, with the model's optimizer).
    objective: the learning rate of the objective's own optimizers (the classifier rows' SGD):
        ``optim.objective_base_lr`` through the same linear scaling, warm-up and cosine; the backbone's
        schedule itself when that is unset, so both read one ``lr_at``.
    weight_decay: the decayed groups' weight decay (``optim.weight_decay_end``); None: constant.
    """

    backbone: LRSchedule
    objective: LRSchedule
    weight_decay: WeightDecaySchedule | None = None

    @classmethod
    def of_job(cls, optim, global_batch: int, steps_per_epoch: int) -> StepSchedules:
        """From the job's ``optim`` section (``trainer.config.OptimSection``)."""
        total_steps = optim.epochs * steps_per_epoch
        warmup_steps = round(optim.warmup_epochs * steps_per_epoch)

        def schedule(base_lr: float) -> LRSchedule:
            peak_lr = scaled_lr(base_lr, optim.base_batch, global_batch)
            return LRSchedule(peak_lr=peak_lr, warmup_steps=warmup_steps, total_steps=total_steps,
                              min_lr=peak_lr * optim.min_lr_ratio)

        backbone = schedule(optim.base_lr)
        objective = backbone if optim.objective_base_lr is None else schedule(optim.objective_base_lr)
        weight_decay = None if optim.weight_decay_end is None else WeightDecaySchedule(
            optim.weight_decay, optim.weight_decay_end, total_steps)
        return cls(backbone, objective, weight_decay)

    def apply(self, step: int, backbone_optimizer, objective) -> float:
        """Sets step ``step``'s learning rates (and decayed weight decay) on the backbone's optimizer and
        on every optimizer of ``objective`` (a ``trainer.objectives.Objective``); returns the backbone's
        learning rate."""
        backbone_lr, objective_lr = self.backbone.lr_at(step), self.objective.lr_at(step)
        backbone_kind = [backbone_optimizer, *objective.backbone_lr_optimizers()]
        for optimizer in (backbone_optimizer, *objective.optimizers()):
            set_lr(optimizer, backbone_lr if any(optimizer is o for o in backbone_kind) else objective_lr)
            if self.weight_decay is not None:
                set_weight_decay(optimizer, self.weight_decay.value_at(step))
        return backbone_lr


def refuse_unused_objective_settings(optim, objective, objective_name: str) -> None:
    """``optim.objective_base_lr`` or ``optim.objective_weight_decay`` set for an objective whose every
    optimizer is the backbone's kind (SwAV) would change nothing: refused, naming the fix, rather
    than ignored."""
    optimizers = objective.optimizers()
    if not optimizers or not all(any(optimizer is o for o in objective.backbone_lr_optimizers())
                                 for optimizer in optimizers):
        return
    for name, backbone_field in (("objective_base_lr", "base_lr"), ("objective_weight_decay", "weight_decay")):
        value = getattr(optim, name)
        if value is not None:
            raise ValueError(f"optim.{name}={value!r} is set, but objective.name={objective_name!r} steps all its "
                             f"parameters with the backbone's optimizer, at {backbone_field}'s value: remove "
                             f"optim.{name} (or set optim.{backbone_field})")
