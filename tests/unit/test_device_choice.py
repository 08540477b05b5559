"""parallel.device: a cluster job asking for CUDA fails fast and says why; ranks never share a GPU
by a modulo; every rank says once what it runs on.  CUDA is faked: this machine has no GPU."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.config import ConfigError, load_job_config
from trainer.engine.run_record import RunRecord
from trainer.observability.logs import JsonlLog
from trainer.observability.metrics import TrainingMetrics
from trainer.observability.what_runs import what_runs
from trainer.parallel.device_choice import choose_device
from trainer.parallel.dims import init_distributed, single_process_dims


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def gpus(monkeypatch):
    """A node with ``n`` visible GPUs."""
    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(n))))
    return fake


def test_cuda_without_a_usable_gpu_names_the_versions_and_the_fix(no_cuda):
    with pytest.raises(RuntimeError) as caught:
        choose_device("cuda", 0)
    message = str(caught.value)
    assert "parallel.device=cuda" in message and "torch.cuda.is_available()=False" in message
    assert f"built for CUDA {torch.version.cuda}" in message or "CPU-only build" in message
    assert "NVIDIA driver" in message and "Fix:" in message


def test_single_process_run_also_refuses_the_cpu_fallback(no_cuda, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="parallel.device=cuda but CUDA cannot start"):
        init_distributed(device="cuda")
    assert init_distributed(device="auto").device.type == "cpu"


def test_auto_and_cpu_fall_back_or_stay_on_cpu(no_cuda, gpus):
    assert choose_device("auto", 3) == torch.device("cpu")
    gpus(8)
    assert choose_device("cpu", 3) == torch.device("cpu")
    assert choose_device("auto", 3, 8) == torch.device("cuda", 3)
    assert choose_device("cuda", 7, 8) == torch.device("cuda", 7)


@pytest.mark.parametrize("local_rank", [0, 3])  # every rank of the node fails, not just the ones past the GPUs
def test_fewer_gpus_than_local_ranks_is_an_error_not_a_modulo(gpus, local_rank):
    gpus(2)
    with pytest.raises(RuntimeError) as caught:
        choose_device("auto", local_rank, local_world_size=4)
    message = str(caught.value)
    assert "4 ranks run on this node but only 2 GPU(s)" in message
    assert "CUDA_VISIBLE_DEVICES=0,1" in message and "--nproc-per-node" in message


def test_init_distributed_checks_the_gpus_before_joining(gpus, monkeypatch):
    gpus(2)
    env = dict(WORLD_SIZE="8", RANK="3", LOCAL_RANK="3", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail(f"set_device({device}) before the check"))
    with pytest.raises(RuntimeError, match="only 2 GPU"):
        init_distributed()


def test_device_field_is_checked_and_cluster_configs_ask_for_cuda(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("data: {train_shards: x}\nparallel: {device: gpu}")
    with pytest.raises(ConfigError, match=r"parallel.device='gpu' is invalid: use auto .* cuda .* cpu"):
        load_job_config(path)
    for name in ("in1k_r50_64gpu", "in21k_r50_64gpu", "pic_in1k_r50", "swav_in1k_r50"):
        assert load_job_config(f"configs/{name}.yaml").parallel.device == "cuda", name
    assert load_job_config("configs/digits_cpu.yaml").parallel.device == "auto"


def test_every_rank_says_once_what_it_runs_on(tmp_path, capsys):
    dims = single_process_dims(torch.device("cpu"))
    record = RunRecord(JsonlLog(tmp_path, 5), TrainingMetrics(5), 5, dims.device)
    facts = what_runs(dims)
    record.started(facts)
    line = capsys.readouterr().err
    (entry,) = [json.loads(text) for text in (tmp_path / "rank-00005.jsonl").read_text().splitlines()]
    assert entry["event"] == "start" and entry["device"] == "cpu" and entry["cuda"] == (torch.version.cuda or "none")
    assert (entry["rank"], entry["world_size"], entry["local_rank"]) == (0, 1, 0)
    assert entry["backend"] == "none (single process)" and entry["torch"] == torch.__version__
    assert {fact: entry[fact] for fact in facts} == facts  # every fact is in the log
    # The console line holds every fact too (the one test of what_runs_line).
    assert len(line.splitlines()) == 1
    assert all(str(value) in line for value in facts.values()), (facts, line)
