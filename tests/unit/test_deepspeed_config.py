"""DeepSpeed configs the trainer refuses, with errors naming the file, the field and the fix."""

import json
from pathlib import Path

import pytest

from trainer.config import ConfigError
from trainer.engine.deepspeed_setup import load_deepspeed_config


@pytest.mark.parametrize("section", ["fp16", "amp"])
def test_fp16_config_is_refused_naming_file_field_and_fix(tmp_path, section):
    path = tmp_path / "zero2_fp16.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, section: {"enabled": True}}))
    with pytest.raises(ConfigError) as error:
        load_deepspeed_config(path, micro_batch=4)
    message = str(error.value)
    assert str(path) in message and f"{section}.enabled" in message
    assert '"bf16": {"enabled": true}' in message and "ds_configs/zero2_bf16.json" in message


def test_bf16_and_disabled_fp16_configs_load(tmp_path):
    path = tmp_path / "zero2.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "fp16": {"enabled": False},
                                "bf16": {"enabled": True}}))
    assert load_deepspeed_config(path, micro_batch=4)["train_micro_batch_size_per_gpu"] == 4


def test_a_copied_job_config_finds_the_shipped_and_its_own_deepspeed_configs_from_anywhere(tmp_path, monkeypatch):
    """Run from a folder outside the checkout (an installed instcls, a user's project): a shipped
    name, or the ds_configs/... spelling the shipped job configs use, is the shipped file; any other
    path is read relative to the job config's folder, else the working directory."""
    import ds_configs
    from trainer.config import load_job_config

    repo = Path(__file__).resolve().parents[2]
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "deepspeed").mkdir(parents=True)
    elsewhere.mkdir()
    copied = project / "job.yaml"
    copied.write_text((repo / "configs" / "digits_cpu.yaml").read_text())
    monkeypatch.chdir(elsewhere)
    shipped = ds_configs.shipped_folder()
    assert load_job_config(copied).deepspeed_config == shipped / "zero0.json"  # ds_configs/zero0.json
    assert load_job_config(copied, ["deepspeed_config=zero2_bf16"]).deepspeed_config == shipped / "zero2_bf16.json"
    own = project / "deepspeed" / "zero1_big_buckets.json"
    own.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert load_job_config(copied, ["deepspeed_config=deepspeed/zero1_big_buckets.json"]).deepspeed_config == own
    (elsewhere / "here.json").write_text("{}")
    assert load_job_config(copied, ["deepspeed_config=here.json"]).deepspeed_config == elsewhere / "here.json"
    with pytest.raises(ConfigError) as error:
        load_job_config(copied, ["deepspeed_config=zero9"])
    message = str(error.value)
    assert str(copied) in message and "deepspeed_config zero9 not found" in message
    assert str(project / "zero9") in message and str(elsewhere / "zero9") in message and "zero2_bf16" in message
    assert sorted(ds_configs.shipped_names()) == sorted(p.stem for p in (repo / "ds_configs").glob("*.json"))


GPU_JOBS = ("in1k_r50_64gpu", "in21k_r50_64gpu", "pic_in1k_r50", "swav_in1k_r50", "in21k_vitb16_64gpu")


@pytest.mark.parametrize("job", GPU_JOBS)
def test_shipped_gpu_jobs_run_a_deepspeed_step_without_host_reads_and_average_gradients_in_fp32(job):
    """The keys that keep DeepSpeed's per-step reads out (the reads themselves are counted in
    tests/integration/test_deepspeed_host_syncs.py) and every gradient averaged in fp32."""
    from trainer.config import load_job_config
    from trainer.engine.deepspeed_host_syncs import host_reads_per_step

    repo = Path(__file__).resolve().parents[2]
    config = load_deepspeed_config(load_job_config(repo / "configs" / f"{job}.yaml").deepspeed_config, micro_batch=4)
    assert host_reads_per_step(config) == []
    autocast = config.get("torch_autocast", {})
    if autocast.get("enabled"):  # fp32 gradients; none all-reduced in bf16
        assert autocast["lower_precision_safe_modules"] == [] and not config.get("bf16", {}).get("enabled")
    else:
        assert config["communication_data_type"] == "fp32" and config["data_types"]["grad_accum_dtype"] == "fp32"


@pytest.mark.parametrize("name, expected", [
    ("zero0_bf16", "overflow"), ("zero1_bf16", "BF16_Optimizer"), ("zero3_bf16", "ZeRO-3"), ("zero1", "norm")])
def test_configs_that_read_the_host_every_step_say_why(name, expected):
    from trainer.engine.deepspeed_host_syncs import host_reads_per_step

    repo = Path(__file__).resolve().parents[2]
    reasons = host_reads_per_step(load_deepspeed_config(repo / "ds_configs" / f"{name}.json", micro_batch=4))
    assert len(reasons) == 1 and expected in reasons[0]


@pytest.mark.parametrize("autocast, fix", [
    ({"enabled": True, "dtype": "float16", "lower_precision_safe_modules": []}, '"dtype": "bfloat16"'),
    ({"enabled": True, "dtype": "bfloat16"}, '"lower_precision_safe_modules": []')])
def test_autocast_configs_that_would_lose_precision_are_refused(tmp_path, autocast, fix):
    """fp16 needs a loss scale; at ZeRO 1-3 DeepSpeed reduces Linear and Conv gradients in bf16 unless
    lower_precision_safe_modules is empty (stage 0 all-reduces the fp32 gradients as they are)."""
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "torch_autocast": autocast}))
    with pytest.raises(ConfigError) as error:
        load_deepspeed_config(path, micro_batch=4)
    assert str(path) in str(error.value) and fix in str(error.value)
    stage0 = {"zero_optimization": {"stage": 0}, "torch_autocast": {**autocast, "dtype": "bfloat16"}}
    path.write_text(json.dumps(stage0))
    assert load_deepspeed_config(path, micro_batch=4)["torch_autocast"]["enabled"]


def test_the_throughput_timer_is_off_unless_the_file_asks_and_then_its_waits_are_named(tmp_path):
    """DeepSpeed turns its throughput timer on by default and it synchronises the device twice a step:
    a file without ``timers`` gets it off; a file that turns it on keeps it, and the rule says why."""
    from trainer.engine.deepspeed_host_syncs import host_reads_per_step

    plain, asks = tmp_path / "plain.json", tmp_path / "asks.json"
    plain.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    asks.write_text(json.dumps({"zero_optimization": {"stage": 0}, "timers": {"throughput": {"enabled": True}}}))
    assert load_deepspeed_config(plain, 8)["timers"] == {"throughput": {"enabled": False}}
    assert host_reads_per_step(load_deepspeed_config(plain, 8)) == []
    kept = load_deepspeed_config(asks, 8)
    assert kept["timers"] == {"throughput": {"enabled": True}}
    assert ["throughput timer" in reason for reason in host_reads_per_step(kept)] == [True]
    unsynchronised = {**kept, "timers": {"throughput": {"enabled": True, "synchronized": False}}}
    assert host_reads_per_step(unsynchronised) == []
    for shipped in sorted((Path(__file__).parents[2] / "ds_configs").glob("*.json")):  # they say so themselves
        assert json.loads(shipped.read_text())["timers"] == {"throughput": {"enabled": False}}, shipped
    clipped = load_deepspeed_config(plain, 8, clip_grad_norm=1.0)
    assert ["gradient clipping" in reason for reason in host_reads_per_step(clipped)] == [True]
