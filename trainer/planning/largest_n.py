"""The largest N (instances, one class each) whose plan fits a memory per rank."""

from __future__ import annotations

from dataclasses import replace

from trainer.planning.plan_input import UNBOUNDED_CLASSES, PlanInput
from trainer.planning.prediction import total


def largest_classes(plan: PlanInput, capacity_bytes: int) -> int:
    """The largest N whose prediction fits ``capacity_bytes`` (0 if even N = ranks does not;
    ``UNBOUNDED_CLASSES`` or more when the memory does not grow with N)."""
    low, high = 0, 1
    while total(replace(plan, num_classes=max(high, plan.ranks))) <= capacity_bytes and high < UNBOUNDED_CLASSES:
        low, high = high, high * 2
    while high - low > max(1, low // 1000):  # 0.1% resolution
        middle = (low + high) // 2
        if total(replace(plan, num_classes=max(middle, plan.ranks))) <= capacity_bytes:
            low = middle
        else:
            high = middle
    return low
