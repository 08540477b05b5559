"""LR schedule and the job config loader's validation messages."""

import math

import pytest

from trainer.config import ConfigError, load_job_config
from trainer.engine.schedule import LRSchedule, scaled_lr


def test_warmup_then_cosine():
    schedule = LRSchedule(peak_lr=1.0, warmup_steps=4, total_steps=14, min_lr=0.1)
    assert [schedule.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule.lr_at(4) == 1.0
    assert math.isclose(schedule.lr_at(9), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(schedule.lr_at(14), 0.1) and math.isclose(schedule.lr_at(100), 0.1)


def test_linear_scaling_rule():
    assert scaled_lr(0.48, 4096, 256) == pytest.approx(0.03)
    assert scaled_lr(0.48, 4096, 8192) == pytest.approx(0.96)


def write(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_shipped_configs_load():
    # The demo turns top-K smoothing off (measured to hurt on its scenes; see configs/demo_cpu.yaml).
    for name, alpha in (("demo_cpu", 0.0), ("digits_cpu", 0.2), ("in1k_r50_64gpu", 0.2), ("in21k_r50_64gpu", 0.2)):
        config = load_job_config(f"configs/{name}.yaml")
        assert config.objective.name == "instance"
        assert config.objective.temperature == 0.15 and config.objective.smoothing_alpha == alpha, name
    paper = load_job_config("configs/in1k_r50_64gpu.yaml")
    assert paper.model.arch == "resnet50" and paper.optim.base_lr == 0.48 and paper.optim.warmup_epochs == 10


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "data: {train_shards: x, loader: {batchsize: 4}}",
            r"unknown field data.loader.batchsize; did you mean data.loader.batch_size\?",
        ),
        (
            "data: {train_shards: x}\noptim: {base_lr: -1}",
            r"optim.base_lr=-1.0 is invalid: use a positive learning rate",
        ),
        ("data: {train_shards: x}\nmodel: {arch: vgg16}", r"model.arch='vgg16' is invalid: choose one of"),
        (
            "data: {train_shards: x}\nmodel: {head: conv}",
            r"model.head='conv' is invalid: choose one of \('mlp', 'linear'\)",
        ),
        ("data: {train_shards: x}\noptim: {epochs: ten}", r"optim.epochs='ten' is invalid: expected an integer"),
        ("model: {arch: resnet18}", r"missing required field\(s\) data"),
        (
            "data: {train_shards: x, loader: {backend: nvidia}}",
            r"data.loader.backend='nvidia' is invalid: choose one of",
        ),
        (
            "data: {train_shards: x, loader: {augment: {crop_scale: [0.5]}}}",
            r"crop_scale=\[0.5\] is invalid: expected a list of 2",
        ),
        ("data: {train_shards: x}\nobjective: {name: instance, top_k: 0}", r"objective.top_k=0 is invalid: use K >= 1"),
        (
            "data: {train_shards: x}\nobjective: {temperature: 0.01}",
            r"objective.temperature=0.01 is invalid: use a temperature >= 0.02",
        ),
        (
            "data: {train_shards: x}\nobjective: {name: simclr}",
            r"objective.name='simclr' is invalid: choose one of \['instance', 'moco', 'pic', 'swav'\]",
        ),
        (
            "data: {train_shards: x}\nobjective: {mode: replicated}",
            r"objective.mode='replicated' is invalid: choose one of \('dhp', 'ddp'\)",
        ),
        (
            "data: {train_shards: x}\nobjective: {name: instance, update_in_backward: true, mode: ddp}",
            r"objective.update_in_backward=True is invalid: the in-backward update needs mode 'dhp'",
        ),
        (
            "data: {train_shards: x}\nobjective: {name: pic, co2_temperature: 0.01}",
            r"objective.co2_temperature=0.01 is invalid: use a temperature >= 0.02",
        ),
        (
            "data: {train_shards: x}\nlogging: {metrics_bind: localhost:9400}",
            r"logging.metrics_bind='localhost:9400' is invalid: use an IP address",
        ),
        (
            "data: {train_shards: x}\noptim: {on_nonfinite: ignore}",
            r"optim.on_nonfinite='ignore' is invalid: use 'stop' or 'skip_step'",
        ),
        ("data: {train_shards: x}\noptim: {max_skipped_in_a_row: 0}", r"optim.max_skipped_in_a_row=0 is invalid"),
        (
            "data: {train_shards: x}\neval: {every_epochs: -1}",
            r"eval.every_epochs=-1 is invalid: use 0 \(only at the end\)",
        ),
        # YAML is read with the safe loader: a tag that would build a Python object is refused.
        (
            "data: {train_shards: !!python/object/apply:os.system [touch /tmp/instcls-yaml-ran]}",
            r"could not determine a constructor for the tag",
        ),
    ],
)
def test_bad_values_name_the_field(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(write(tmp_path, text))


def test_overrides_apply_and_are_checked(tmp_path):
    path = write(tmp_path, "data: {train_shards: x}")
    config = load_job_config(
        path, ["optim.epochs=3", "optim.warmup_epochs=1", "data.loader.augment.crop_scale=[0.5, 1.0]"]
    )
    assert config.optim.epochs == 3 and config.data.loader.augment.crop_scale == (0.5, 1.0)
    with pytest.raises(ConfigError, match="use --set section.field=value"):
        load_job_config(path, ["optim.epochs"])
    with pytest.raises(ConfigError, match=r"optim.warmup_epochs=10.0 is invalid: use 0 <= warmup_epochs <= epochs"):
        load_job_config(path, ["optim.epochs=3"])


def test_objective_configs_run_the_classifier_settings_checks():
    """The settings are inherited, not copied: each objective config checks them, with its hint."""
    from trainer.objectives import InstanceConfig, PicConfig

    with pytest.raises(ValueError, match=r"temperature=0.001 is invalid: .*\(paper: 0.15\)"):
        InstanceConfig(temperature=0.001)
    with pytest.raises(ValueError, match=r"temperature=0.01 is invalid: .*\(paper: 0.2\)"):
        PicConfig(temperature=0.01)
    with pytest.raises(ValueError, match=r"init_std=0 is invalid"):
        PicConfig(init_std=0)
    with pytest.raises(ValueError, match=r"top_k=0 is invalid"):
        InstanceConfig(top_k=0)
    assert InstanceConfig().smoothing_alpha == 0.2 and PicConfig().temperature == 0.2
