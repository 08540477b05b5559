"""A rank's whole memory: the objective's, the backbone's and the runtime's, by term."""

from __future__ import annotations

from trainer.planning.backbone_memory import backbone_breakdown
from trainer.planning.objective_memory import objective_breakdown
from trainer.planning.plan_input import PlanInput
from trainer.planning.runtime_memory import runtime_breakdown


def predict(plan: PlanInput) -> dict[str, int]:
    return objective_breakdown(plan) | backbone_breakdown(plan) | runtime_breakdown(plan)


def total(plan: PlanInput) -> int:
    return sum(predict(plan).values())
