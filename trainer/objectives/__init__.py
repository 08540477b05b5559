"""Training methods, one ``Objective`` each, selected by ``objective: {name: ...}`` in the job config."""

from trainer.objectives.base import (
    OBJECTIVES, LossOut, Objective, ObjectiveConfig, ObjectiveContext, OptimSettings, ShardedRows, StepViews, View,
    average_gradients, build_objective, objective_config_class, objective_parameters, register_objective,
)
from trainer.objectives.instance import InstanceConfig, InstanceObjective
from trainer.objectives.pic import PicConfig, PicObjective

register_objective("instance", InstanceConfig, InstanceObjective)
register_objective("pic", PicConfig, PicObjective)

__all__ = [
    "OBJECTIVES", "InstanceConfig", "InstanceObjective", "LossOut", "Objective", "ObjectiveConfig",
    "ObjectiveContext", "OptimSettings", "PicConfig", "PicObjective", "ShardedRows", "StepViews", "View", "average_gradients",
    "build_objective", "objective_config_class", "objective_parameters", "register_objective",
]
