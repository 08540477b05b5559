"""`instcls plan --config FILE`: the planner's inputs read from a job config instead of flags.

What the config cannot say comes from the command line: the number of ranks (a launch-time
choice) and, when the config's training shards are not on this machine, N.
"""

from __future__ import annotations

from pathlib import Path

from trainer.bench.planner import PlanInput, deepspeed_settings
from trainer.config import JobConfig


def num_instances_of(config: JobConfig, num_classes: int | None) -> int:
    """N: ``num_classes`` when given, else the size of the config's training shard set."""
    if num_classes is not None:
        return num_classes
    from data_pipeline.shardset.manifest import MANIFEST_NAME, ShardManifest

    shards = Path(config.data.train_shards)
    if not (shards / MANIFEST_NAME).is_file():
        raise ValueError(f"data.train_shards={shards} has no {MANIFEST_NAME} on this machine: give the number of "
                         "samples with --num-classes N")
    return ShardManifest.load(shards).num_instances


def plan_input_from_config(config: JobConfig, ranks: int, num_classes: int | None) -> PlanInput:
    """Every view is counted at the global crop's size (an upper bound for multi-crop's local views)."""
    from trainer.engine.deepspeed_setup import load_deepspeed_config

    objective, loader = config.objective, config.data.loader
    pic = objective.name == "pic"
    settings = deepspeed_settings(load_deepspeed_config(config.deepspeed_config, loader.batch_size))
    return PlanInput(
        mode="pic" if pic else getattr(objective, "mode", "dhp"), num_classes=num_instances_of(config, num_classes),
        ranks=ranks, batch=loader.batch_size * ranks, dim=config.model.feature_dim,
        chunk_size=getattr(objective, "chunk_size", 65536),
        logits_cache_bytes=getattr(objective, "logits_cache_bytes", 0),
        momentum=config.optim.momentum > 0, update_in_backward=getattr(objective, "update_in_backward", False),
        backbone=config.model.arch, head_hidden_dim=config.model.head_hidden_dim,
        img_size=config.model.img_size, patch_size=config.model.patch_size,
        image_size=max(loader.view_layout.sides), views=len(loader.view_layout.kinds),
        device="cpu" if config.parallel.device == "cpu" else "gpu",
        queue=getattr(objective, "queue_size", 65536), row_store=getattr(objective, "row_store", "host"),
        co2=getattr(objective, "co2_alpha", 0.0) > 0, dali=loader.backend == "dali",
        dali_prefetch=loader.prefetch_depth, kernel=getattr(objective, "kernel", "auto"),
        targets=1 + (getattr(objective, "top_k", 0) if getattr(objective, "smoothing_alpha", 0.0) > 0 else 0),
        checkpoints=bool(config.checkpoint.every_steps or config.checkpoint.every_epochs),
        **settings,
    )
