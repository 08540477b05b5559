"""Linear warm-up then cosine decay, shared by the DeepSpeed backbone optimizer and the
classifier's own SGD so both move on exactly the same schedule."""

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
