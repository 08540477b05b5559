"""`instcls plan --config FILE`: the planner's inputs read from a job config instead of flags.

What the config cannot say comes from the command line: the number of ranks (a launch-time
choice) and, when the config's training shards are not on this machine, N.  The objective's side is
its own description (``ObjectiveConfig.memory_plan``); an objective without one is refused.
"""

from __future__ import annotations

from trainer.config import JobConfig
from trainer.config_deepspeed import load_deepspeed_config
from trainer.planning.plan_input import PlanInput, deepspeed_settings


def num_instances_of(config: JobConfig, num_classes: int | None) -> int:
    """N: ``num_classes`` when given, else the size of the config's training shard set."""
    if num_classes is not None:
        return num_classes
    from data_pipeline.contract import MANIFEST_NAME, has_manifest, load_manifest, use_storage_settings

    shards = config.data.train_shards
    use_storage_settings(config.data.storage)
    if not has_manifest(shards):
        raise ValueError(f"data.train_shards={shards} has no {MANIFEST_NAME} reachable from this machine: give the "
                         "number of samples with --num-classes N")
    return load_manifest(shards).num_instances


def plan_input_from_config(config: JobConfig, ranks: int, num_classes: int | None) -> PlanInput:
    """Every view the student encodes (``ObjectiveConfig.student_views``) at its own side (multi-crop's
    small crops are smaller).  N is read (or asked for) only when the objective's memory depends on it."""
    loader = config.data.loader
    student = config.objective.student_views(loader.view_layout)
    sides = tuple(loader.view_layout.sides[i] for i in (student or range(loader.view_layout.num_views)))
    objective = config.objective.memory_plan(loader.view_layout)
    settings = deepspeed_settings(load_deepspeed_config(config.deepspeed_config, loader.batch_size))
    return PlanInput(
        mode=objective.kind, objective=objective,
        num_classes=num_instances_of(config, num_classes) if objective.grows_with_instances else num_classes or 0,
        ranks=ranks, batch=loader.batch_size * ranks, dim=config.model.feature_dim,
        momentum=config.optim.momentum > 0, optimizer=config.optim.name,
        activation_checkpointing=config.model.activation_checkpointing,
        backbone=config.model.arch, head_hidden_dim=config.model.head_hidden_dim,
        img_size=config.model.img_size, patch_size=config.model.patch_size,
        image_size=max(sides), views=len(sides), view_sides=sides,
        device="cpu" if config.parallel.device == "cpu" else "gpu",
        dali=loader.backend == "dali", dali_prefetch=loader.prefetch_depth,
        checkpoints=bool(config.checkpoint.every_steps or config.checkpoint.every_epochs),
        teacher=config.objective.teacher_request(loader.view_layout) is not None,
        **settings,
    )
