"""The optimizer's job-config fields: each bad value named with its fix, another optimizer's field
refused, gradient clipping set from the job config (and refused where DeepSpeed computes no
gradient norm), the weight-decay schedule, and the shipped SwAV recipe on LARS."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from trainer.config import ConfigError, load_job_config
from trainer.engine.deepspeed_setup import load_deepspeed_config
from trainer.engine.schedule import WeightDecaySchedule, set_weight_decay
from trainer.optim import OptimizerSettings, build_optimizer


def _job(tmp_path, optim: str):
    path = tmp_path / "job.yaml"
    path.write_text(f"data: {{train_shards: x}}\noptim: {optim}")
    return load_job_config(path)


@pytest.mark.parametrize("optim, message", [
    ("{name: lamb}", r"optim.name='lamb' is invalid: choose one of adamw, lars, sgd"),
    ("{name: adamw, betas: [0.9, 1.0]}", r"optim.betas=\(0.9, 1.0\) is invalid: use two decays in \[0, 1\)"),
    ("{name: lars, trust_coefficient: 0}", r"optim.trust_coefficient=0.0 is invalid: use a positive coefficient"),
    ("{name: adamw, eps: 0}", r"optim.eps=0.0 is invalid: use a small positive guard"),
    ("{clip_grad_norm: -1}", r"optim.clip_grad_norm=-1.0 is invalid: use a positive norm to clip to, or 0"),
    ("{weight_decay_end: -0.1}", r"optim.weight_decay_end=-0.1 is invalid: use a non-negative weight decay, or null"),
    ("{betas: [0.9, 0.95]}", r"optim.betas=\(0.9, 0.95\) is set, but optim.name='sgd' does not read it \(only adamw "
                             r"does\): remove it or choose that optimizer"),
    ("{name: adamw, trust_coefficient: 0.02}", r"optim.trust_coefficient=0.02 is set, but optim.name='adamw' does "
                                               r"not read it \(only lars does\)"),
])
def test_bad_optimizer_fields_are_named_with_their_fix(tmp_path, optim, message):
    with pytest.raises(ConfigError, match=message):
        _job(tmp_path, optim)


def test_the_optimizer_settings_follow_the_config(tmp_path):
    config = _job(tmp_path, "{name: adamw, betas: [0.9, 0.95], weight_decay: 0.05, exclude_from_decay: false}")
    assert config.optim.optimizer_settings() == OptimizerSettings(
        name="adamw", momentum=0.9, weight_decay=0.05, betas=(0.9, 0.95), eps=1e-8, trust_coefficient=0.001,
        exclude_from_decay=False)


def test_the_shipped_swav_recipe_runs_lars_over_every_parameter_at_its_learning_rate():
    optim = load_job_config("configs/swav_in1k_r50.yaml").optim
    assert (optim.name, optim.base_lr, optim.base_batch, optim.weight_decay) == ("lars", 4.8, 4096, 1e-6)
    assert optim.trust_coefficient == 0.001 and optim.exclude_from_decay is False and optim.clip_grad_norm == 0
    for name in ("in1k_r50_64gpu", "in21k_r50_64gpu", "pic_in1k_r50"):
        assert load_job_config(f"configs/{name}.yaml").optim.name == "sgd", name


def _deepspeed_file(tmp_path, **zero) -> str:
    path = tmp_path / "zero2.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, **zero}, "gradient_clipping": 0.0}))
    return path


def test_clipping_comes_from_the_job_config_and_needs_deepspeeds_gradient_norm(tmp_path):
    assert load_deepspeed_config(_deepspeed_file(tmp_path), 4, clip_grad_norm=1.0)["gradient_clipping"] == 1.0
    assert load_deepspeed_config(_deepspeed_file(tmp_path), 4)["gradient_clipping"] == 0.0
    no_norm = _deepspeed_file(tmp_path, compute_grad_norm=False)
    assert load_deepspeed_config(no_norm, 4)["gradient_clipping"] == 0.0  # no clipping: no norm needed
    with pytest.raises(ConfigError) as error:
        load_deepspeed_config(no_norm, 4, clip_grad_norm=1.0)
    message = str(error.value)
    assert "optim.clip_grad_norm=1.0 needs the gradient norm" in message and str(no_norm) in message
    assert "zero_optimization.compute_grad_norm: false: remove that key" in message
    assert "or set optim.clip_grad_norm: 0" in message


def test_a_deepspeed_file_that_clips_otherwise_is_refused(tmp_path):
    path = tmp_path / "own.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 3.0}))
    assert load_deepspeed_config(path, 4)["gradient_clipping"] == 3.0
    assert load_deepspeed_config(path, 4, clip_grad_norm=3.0)["gradient_clipping"] == 3.0
    with pytest.raises(ConfigError, match=r"optim.clip_grad_norm=1.0 and gradient_clipping=3.0 in .*own.json "
                                          r"disagree: set the clipping in the job config"):
        load_deepspeed_config(path, 4, clip_grad_norm=1.0)


def test_the_weight_decay_schedule_is_a_cosine_that_leaves_the_no_decay_group_alone():
    schedule = WeightDecaySchedule(start=0.04, end=0.4, total_steps=11)
    assert schedule.value_at(0) == pytest.approx(0.04) and schedule.value_at(10) == pytest.approx(0.4)
    assert schedule.value_at(5) == pytest.approx(0.4 + (0.04 - 0.4) * 0.5 * (1 + math.cos(math.pi * 0.5)))
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    optimizer = build_optimizer(OptimizerSettings(name="adamw", weight_decay=0.04), model, lr=1e-3)
    classifier_sgd = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, weight_decay=1e-4)
    for target in (optimizer, classifier_sgd):
        set_weight_decay(target, schedule.value_at(10))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [pytest.approx(0.4), 0.0]
    assert classifier_sgd.param_groups[0]["weight_decay"] == 1e-4
