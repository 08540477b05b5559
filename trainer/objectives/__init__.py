"""Training methods, one ``Objective`` each, selected by ``objective: {name: ...}`` in the job config."""

from trainer.objectives.base import (
    OBJECTIVES,
    LossOut,
    Objective,
    ObjectiveConfig,
    ObjectiveContext,
    OptimSettings,
    ShardedRows,
    StepViews,
    View,
    average_gradients,
    build_objective,
    objective_config_class,
    objective_parameters,
    register_objective,
)
from trainer.objectives.instance.objective import InstanceConfig, InstanceObjective
from trainer.objectives.memory_plan import (
    ClassifierRows,
    NoMemoryPlan,
    ObjectiveMemoryPlan,
    Prototypes,
    QueuedKeys,
    SampledRows,
)
from trainer.objectives.moco.objective import MocoConfig, MocoObjective
from trainer.objectives.pic.objective import PicConfig, PicObjective
from trainer.objectives.swav.objective import SwavConfig, SwavObjective
from trainer.objectives.teacher_request import TeacherRequest

register_objective("instance", InstanceConfig, InstanceObjective)
register_objective("pic", PicConfig, PicObjective)
register_objective("swav", SwavConfig, SwavObjective)
register_objective("moco", MocoConfig, MocoObjective)

DEFAULT_OBJECTIVE = "instance"  # what a job config without ``objective.name`` trains: the paper's method


def default_objective_config() -> ObjectiveConfig:
    """The objective section of a job config that leaves ``objective`` out."""
    return objective_config_class(DEFAULT_OBJECTIVE)()


__all__ = [
    "ClassifierRows",
    "DEFAULT_OBJECTIVE",
    "OBJECTIVES",
    "default_objective_config",
    "InstanceConfig",
    "InstanceObjective",
    "LossOut",
    "NoMemoryPlan",
    "Objective",
    "ObjectiveConfig",
    "ObjectiveContext",
    "ObjectiveMemoryPlan",
    "OptimSettings",
    "MocoConfig",
    "MocoObjective",
    "PicConfig",
    "PicObjective",
    "Prototypes",
    "QueuedKeys",
    "SampledRows",
    "SwavConfig",
    "SwavObjective",
    "ShardedRows",
    "StepViews",
    "TeacherRequest",
    "View",
    "average_gradients",
    "build_objective",
    "objective_config_class",
    "objective_parameters",
    "register_objective",
]
