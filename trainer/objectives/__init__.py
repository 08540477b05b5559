"""Training methods, one ``Objective`` each, selected by ``objective: {name: ...}`` in the job config."""

from trainer.objectives.base import (
    OBJECTIVES, LossOut, Objective, ObjectiveConfig, ObjectiveContext, OptimSettings, ShardedRows, StepViews, View,
    average_gradients, build_objective, objective_config_class, objective_parameters, register_objective,
)
from trainer.objectives.instance import InstanceConfig, InstanceObjective
from trainer.objectives.pic import PicConfig, PicObjective
from trainer.objectives.swav import SwavConfig, SwavObjective

register_objective("instance", InstanceConfig, InstanceObjective)
register_objective("pic", PicConfig, PicObjective)
register_objective("swav", SwavConfig, SwavObjective)

__all__ = [
    "OBJECTIVES", "InstanceConfig", "InstanceObjective", "LossOut", "Objective", "ObjectiveConfig",
    "ObjectiveContext", "OptimSettings", "PicConfig", "PicObjective", "SwavConfig", "SwavObjective", "ShardedRows", "StepViews", "View", "average_gradients",
    "build_objective", "objective_config_class", "objective_parameters", "register_objective",
]
