"""The backbone's optimizers, selected by ``optim.name`` in the job config: sgd, lars, adamw.

Each is one module here (its optimizer class and an ``OptimizerSpec``) and one
``register_optimizer`` line below.  Every optimizer:

- takes the param groups of ``param_groups.parameter_groups`` (a decayed group and, with
  ``optim.exclude_from_decay``, one of norms, biases, position embeddings and class tokens without
  decay; LARS does not adapt it either);
- steps with ``step(closure=None, apply=None)``, ``apply`` a flag on the device
  (``conditional.py``);
- creates its state through ``initial_state(tensor, group)``, so a checkpoint can load state into
  it before the first step and carries every key it keeps (``trainer.checkpoint.optimizer_state``);
- may take ``use_partitions`` (LARS does) to see how DeepSpeed cut the tensors it steps
  (``partitions.py``).
"""

from trainer.optim import adamw, lars, sgd
from trainer.optim.conditional import ConditionalStep
from trainer.optim.param_groups import excluded_from_decay, parameter_groups
from trainer.optim.partitions import (
    FlatPartition,
    Fragment,
    create_initial_state,
    optimizer_partitions,
    state_owners,
    stepped_tensors,
)
from trainer.optim.registry import (
    OPTIMIZERS,
    OptimizerSettings,
    OptimizerSpec,
    build_optimizer,
    optimizer_names,
    optimizer_spec,
    register_optimizer,
    unregister_optimizer,
)

register_optimizer(sgd.SPEC)
register_optimizer(lars.SPEC)
register_optimizer(adamw.SPEC)

__all__ = [
    "OPTIMIZERS",
    "ConditionalStep",
    "FlatPartition",
    "Fragment",
    "OptimizerSettings",
    "OptimizerSpec",
    "build_optimizer",
    "create_initial_state",
    "excluded_from_decay",
    "optimizer_names",
    "optimizer_partitions",
    "optimizer_spec",
    "parameter_groups",
    "register_optimizer",
    "state_owners",
    "stepped_tensors",
    "unregister_optimizer",
]
