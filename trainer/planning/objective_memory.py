"""The objective's side of a rank's memory, from its own description (``ObjectiveConfig.memory_plan``).

Each kind of description (``trainer.objectives.memory_plan``) has one memory model here: its
breakdown per rank, and what a background save stages of it.  A new kind of objective state is one
description there and one ``register_memory_model`` line below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trainer.objectives.memory_plan import ClassifierRows, ObjectiveMemoryPlan, Prototypes, QueuedKeys, SampledRows
from trainer.planning.classifier_memory import classifier_rows_breakdown, rows_checkpoint_bytes, sampled_rows_breakdown
from trainer.planning.plan_input import PlanInput
from trainer.planning.prototype_memory import prototypes_breakdown, prototypes_checkpoint_bytes
from trainer.planning.queue_memory import queued_keys_breakdown, queued_keys_checkpoint_bytes


@dataclass(frozen=True)
class MemoryModel:
    breakdown: Callable[[PlanInput, ObjectiveMemoryPlan], dict[str, int]]  # bytes per rank, by term
    checkpoint_bytes: Callable[[PlanInput, ObjectiveMemoryPlan], int]  # what a save stages of it
    checkpoint_label: str  # what that is, in the plan's line "checkpoint copies: ..."


MEMORY_MODELS: dict[type, MemoryModel] = {}


def register_memory_model(description: type, model: MemoryModel) -> None:
    MEMORY_MODELS[description] = model


register_memory_model(ClassifierRows, MemoryModel(classifier_rows_breakdown, rows_checkpoint_bytes, "classifier rows"))
register_memory_model(SampledRows, MemoryModel(sampled_rows_breakdown, rows_checkpoint_bytes, "classifier rows"))
register_memory_model(Prototypes, MemoryModel(prototypes_breakdown, prototypes_checkpoint_bytes,
                                              "prototypes, queue"))
register_memory_model(QueuedKeys, MemoryModel(queued_keys_breakdown, queued_keys_checkpoint_bytes, "key queue"))


def memory_model(plan: PlanInput) -> MemoryModel:
    description = plan.objective_plan
    if type(description) not in MEMORY_MODELS:
        raise ValueError(f"the planner has no memory model for {type(description).__name__}: register one with "
                         "trainer.planning.objective_memory.register_memory_model")
    return MEMORY_MODELS[type(description)]


def objective_breakdown(plan: PlanInput) -> dict[str, int]:
    """The objective's bytes per rank, by term (the classifier's for the flag-driven plan)."""
    return memory_model(plan).breakdown(plan, plan.objective_plan)


def objective_checkpoint_bytes(plan: PlanInput) -> int:
    return memory_model(plan).checkpoint_bytes(plan, plan.objective_plan)
