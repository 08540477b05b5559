"""Every setting of a job config refuses a bad value with a message that names it in full and says
what to use instead.

The fields are found by walking ``JobConfig`` and every shipped objective's config with
``dataclasses.fields``, so a field added later fails ``test_every_field_has_a_bad_value`` until it
gets a row here, and with it a check: a row whose value is accepted fails
``test_each_bad_value_is_refused_naming_the_field``.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from trainer.config import JobConfig
from trainer.config_building import ConfigError, build_dataclass
from trainer.objectives import OBJECTIVES, ObjectiveConfig

# One bad value per field, as a YAML file would hold it.  The objective's fields are keyed
# ``objective[NAME].field``: each objective has its own config class.
BAD_VALUES: dict[str, object] = {
    "data.train_shards": 7,
    "data.eval_shards": ["a", "b"],
    "data.knn_bank_shards": 3.5,
    "data.loader.batch_size": 0,
    "data.loader.backend": "nvidia",
    "data.loader.num_threads": 0,
    "data.loader.prefetch_depth": 0,
    "data.loader.last_batch": "keep",
    "data.loader.seed": -1,
    "data.loader.augment.recipe": "simclr_v3",
    "data.loader.augment.image_size": 0,
    "data.loader.augment.num_views": 0,
    "data.loader.augment.crop_scale": [0.9, 0.1],
    "data.loader.augment.small_crops": -2,
    "data.loader.augment.small_size": 0,
    "data.loader.augment.small_scale": [0.0, 0.1],
    "data.loader.augment.flip_prob": 1.5,
    "data.loader.augment.jitter": [-0.4, 0.4, 0.4, 0.1],
    "data.loader.augment.jitter_prob": -0.1,
    "data.loader.augment.grayscale_prob": 2.0,
    "data.loader.augment.blur_prob": float("nan"),
    "data.loader.augment.solarize_prob": -0.2,
    "data.loader.augment.blur_sigma": [2.0, 0.1],
    "data.loader.augment.eval_resize": 0.0,
    "data.loader.sampler.kind": "random",
    "data.loader.sampler.window_size": -1,
    "data.loader.sampler.stride": -1,
    "data.loader.on_bad_sample": "ignore",
    "data.storage.endpoint_url": "seaweedfs:8333",
    "data.storage.region": 5,
    "data.storage.addressing": "dns",
    "data.storage.unsigned": "no",
    "data.storage.client": "curl",
    "data.storage.max_in_flight": 0,
    "data.storage.connect_timeout_s": 0,
    "data.storage.read_timeout_s": -1,
    "data.storage.outage_retry_s": -5,
    "data.storage.table_cache_dir": 12,
    "model.arch": "resnet51",
    "model.small_input_stem": "yes",
    "model.img_size": 0,
    "model.patch_size": -16,
    "model.pool": "max",
    "model.input_norm": "zscore",
    "model.head": "transformer",
    "model.head_hidden_dim": 0,
    "model.feature_dim": -128,
    "model.batch_norm": "group",
    "model.sync_batch_norm_group": "rack",
    "model.channels_last": 1,
    "model.compile": "true",
    "model.activation_checkpointing": 0,
    "model.init_from": 12,
    "model.init_strict": "no",
    "model.init_from_part": "momentum",
    "objective[instance].name": "simclr",
    "objective[instance].temperature": 0.0,
    "objective[instance].chunk_size": 0,
    "objective[instance].init_std": -0.01,
    "objective[instance].co2_alpha": -1.0,
    "objective[instance].co2_temperature": 0.0,
    "objective[instance].kernel": "cuda",
    "objective[instance].mode": "replicated",
    "objective[instance].smoothing_alpha": 1.5,
    "objective[instance].top_k": 0,
    "objective[instance].smoothing_form": "uniform",
    "objective[instance].logits_cache_bytes": -1,
    "objective[instance].contrastive_prior": "on",
    "objective[instance].smoothing_start_epoch": -1,
    "objective[instance].update_in_backward": "yes",
    "objective[pic].name": "picc",
    "objective[pic].temperature": -0.2,
    "objective[pic].chunk_size": -1,
    "objective[pic].init_std": 0.0,
    "objective[pic].co2_alpha": float("nan"),
    "objective[pic].co2_temperature": -0.05,
    "objective[pic].kernel": "triton",
    "objective[pic].negatives": "hardest",
    "objective[pic].queue_size": -1,
    "objective[pic].row_store": "ssd",
    "objective[pic].row_store_dir": 5,
    "objective[pic].row_dtype": "int8",
    "objective[pic].prefetch": "always",
    "objective[swav].name": "swav2",
    "objective[swav].num_prototypes": 0,
    "objective[swav].temperature": 0.0,
    "objective[swav].epsilon": 0.0,
    "objective[swav].sinkhorn_iterations": 0,
    "objective[swav].sinkhorn_dtype": "float8",
    "objective[swav].freeze_prototypes_steps": -1,
    "objective[swav].queue_length": -1,
    "objective[swav].queue_start_epoch": -1,
    "objective[swav].collapse_log_steps": 0,
    "objective[moco].name": "moco3",
    "objective[moco].temperature": 0.0,
    "objective[moco].chunk_size": 0,
    "objective[moco].init_std": -1.0,
    "objective[moco].co2_alpha": -0.3,
    "objective[moco].co2_temperature": 0.0,
    "objective[moco].kernel": "cuda",
    "objective[moco].queue_size": 0,
    "objective[moco].momentum": 1.5,
    "parallel.classifier_parallel_size": 0,
    "parallel.device": "tpu",
    "parallel.deterministic": "yes",
    "parallel.collectives_over_one_rank": 1,
    "parallel.elastic.memory_check": "yes",
    "parallel.elastic.memory_margin": 1.5,
    "parallel.collective_timeout_s": 0,
    "optim.epochs": 0,
    "optim.base_lr": 0.0,
    "optim.base_batch": 0,
    "optim.objective_base_lr": -1.0,
    "optim.objective_weight_decay": -0.1,
    "optim.warmup_epochs": -1.0,
    "optim.min_lr_ratio": 1.5,
    "optim.momentum": 1.0,
    "optim.weight_decay": -1e-4,
    "optim.on_nonfinite": "ignore",
    "optim.max_skipped_in_a_row": 0,
    "optim.name": "adam",
    "optim.exclude_from_decay": "bias",
    "optim.betas": [0.9, 1.5],
    "optim.eps": 0.0,
    "optim.trust_coefficient": 0.0,
    "optim.weight_decay_end": -1.0,
    "optim.clip_grad_norm": -1.0,
    "checkpoint.dir": None,
    "checkpoint.every_epochs": -1,
    "checkpoint.every_steps": -1,
    "checkpoint.keep_last": 0,
    "checkpoint.keep": 0,
    "logging.dir": 3,
    "logging.log_every": 0,
    "logging.metrics_port": 70000,
    "logging.metrics_bind": "localhost:9400",
    "logging.progress": "yes",
    "logging.progress_every_s": -1.0,
    "logging.consumed_ids": 1,
    "logging.tensorboard": "on",
    "logging.trainjob_status": "true",
    "logging.mlflow.tracking_uri": 5000,
    "logging.mlflow.experiment": " ",
    "logging.mlflow.run_name": ["a"],
    "logging.mlflow.request_timeout_s": float("nan"),
    "logging.mlflow.retries": True,
    "eval.knn_k": 0,
    "eval.knn_temperature": 0.0,
    "eval.knn_at_end": "yes",
    "eval.every_epochs": -1,
    "eval.linear_at_end": 2,
    "eval.linear.method": "svm",
    "eval.linear.sgd_from_samples": -1,
    "eval.linear.epochs": 0,
    "eval.linear.batch_size": 0,
    "eval.linear.learning_rates": [],
    "eval.linear.weight_decays": [-1.0],
    "eval.linear.momentum": 1.0,
    "eval.linear.held_out": 1.0,
    "eval.linear.seed": -1,
    "eval.bank_dtype": "int8",
    "eval.bank_samples": 0,
    "eval.bank_subset_seed": -1,
    "deepspeed_config": 4,
    "seed": -1,
    "max_steps": 0,
}

# Words with which a message says what to use instead.
FIX_WORDS = ("use ", "choose ", "expected ", "give ", "keep ", "hold out", "remove ", "set ", "train ", "allow ")


def _shipped_objectives() -> dict[str, type]:
    """The objectives instcls ships (tests register toy ones too, which are theirs to check)."""
    return {name: entry.config for name, entry in OBJECTIVES.items()
            if entry.config.__module__.startswith("trainer.")}


def _field_names(settings_class: type, prefix: str) -> list[str]:
    names = []
    hints = typing.get_type_hints(settings_class)
    for field in dataclasses.fields(settings_class):
        hint = hints[field.name]
        if hint is ObjectiveConfig:
            for name, config_class in sorted(_shipped_objectives().items()):
                names += _field_names(config_class, f"{prefix}objective[{name}].")
        elif dataclasses.is_dataclass(hint):
            names += _field_names(hint, f"{prefix}{field.name}.")
        else:
            names.append(prefix + field.name)
    return names


def _config_with(key: str, value) -> tuple[dict, str]:
    """A valid config's data with one field set to ``value``, and the field's name in a message."""
    data: dict = {"data": {"train_shards": "shards"}}
    if key.startswith("objective["):
        name, field = key[len("objective["):].split("].")
        data["objective"] = {"name": name}
        key = f"objective.{field}"
    node = data
    *sections, field = key.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[field] = value
    return data, key


def test_the_walk_reaches_every_section_and_objective():
    names = _field_names(JobConfig, "")
    assert {"instance", "pic", "swav"} <= set(_shipped_objectives())
    assert "data.loader.augment.crop_scale" in names and "objective[swav].epsilon" in names
    assert "eval.linear.held_out" in names and "max_steps" in names


def test_every_field_has_a_bad_value():
    names = _field_names(JobConfig, "")
    missing = [name for name in names if name not in BAD_VALUES]
    assert not missing, f"give these fields a bad value in BAD_VALUES (and a check in their section): {missing}"
    stale = sorted(set(BAD_VALUES) - set(names))
    assert not stale, f"BAD_VALUES names fields that no longer exist: {stale}"


def test_the_valid_base_config_builds():
    """The rows differ from it in one field only, so each refusal is that field's."""
    for name in _shipped_objectives():
        build_dataclass(JobConfig, {"data": {"train_shards": "shards"}, "objective": {"name": name}}, "")


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
def test_each_bad_value_is_refused_naming_the_field(key):
    data, field = _config_with(key, BAD_VALUES[key])
    with pytest.raises(ConfigError) as refused:
        build_dataclass(JobConfig, data, "")
    message = str(refused.value)
    assert field + "=" in message, message
    assert any(word in message for word in FIX_WORDS), f"the message says no fix: {message}"
