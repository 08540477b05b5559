"""The memory planner (`instcls plan`): a job's memory per rank before it is launched, by term, at
every ZeRO stage, and the stage to run.

One module per job: the question (``plan_input``: the job's shape and DeepSpeed settings), the
objective's side from its own description (``objective_memory``: ``classifier_memory`` for N-way
classifiers, ``prototype_memory`` for SwAV), the backbone's (``backbone_memory``), the runtime's
(``runtime_memory``), their sum (``prediction``), the largest N that fits (``largest_n``), the ZeRO
stage recommended (``zero_stages``), and what `instcls plan` prints (``report``).  A config's
inputs: ``plan_from_config``.  The benchmarks' per-rank memory cap: ``memory_cap``.
"""

from trainer.planning.backbone_memory import backbone_breakdown
from trainer.planning.largest_n import largest_classes
from trainer.planning.objective_memory import objective_breakdown
from trainer.planning.plan_input import GIB, PlanInput, deepspeed_settings
from trainer.planning.prediction import predict, total
from trainer.planning.report import format_plan, plan_modes
from trainer.planning.runtime_memory import checkpoint_host_copies, runtime_breakdown
from trainer.planning.zero_stages import recommend_stage

__all__ = [
    "GIB",
    "PlanInput",
    "backbone_breakdown",
    "checkpoint_host_copies",
    "deepspeed_settings",
    "format_plan",
    "largest_classes",
    "objective_breakdown",
    "plan_modes",
    "predict",
    "recommend_stage",
    "runtime_breakdown",
    "total",
]
