"""`instcls plan --cpu` plans a CPU rank's whole memory: besides the tensors, the runtime itself
(measured) and the host copies a background checkpoint keeps for the next one."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.host_copies import kept_bytes
from trainer.bench import runtime_baseline
from trainer.checkpoint.components import component_plan
from trainer.checkpoint.save_plan import HostStager
from trainer.objectives import InstanceConfig, InstanceObjective, ObjectiveContext, OptimSettings
from trainer.parallel import single_process_dims
from trainer.planning import PlanInput, checkpoint_host_copies, predict

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
MIB = 2**20


@pytest.mark.parametrize("top_k", [0, 10])
def test_the_plan_counts_the_classifier_rows_the_stager_keeps(top_k):
    rows, dim = 8_000, 128
    dims = single_process_dims(torch.device("cpu"))
    objective = InstanceObjective(
        InstanceConfig(smoothing_alpha=0.2 if top_k else 0.0, top_k=top_k or 100, contrastive_prior=False),
        ObjectiveContext(dims=dims, num_instances=rows, feature_dim=dim, seed=0, optim=OptimSettings(0.9, 1e-4)))
    objective.on_epoch_start(0)  # with smoothing: the search, whose table the checkpoint holds
    weight = objective.classifier.weight
    objective.optimizer.state[weight]["momentum_buffer"] = torch.zeros_like(weight)  # as after the first step
    stager = HostStager(torch.device("cpu"))
    kept = kept_bytes(stager.stage(component_plan("objective", objective, dims)))
    planned = checkpoint_host_copies(PlanInput(mode="dhp", num_classes=rows, ranks=1, dim=dim, device="cpu",
                                               targets=1 + top_k, checkpoints=True))
    assert abs(kept / planned["checkpoint copies: classifier rows"] - 1) < 0.01, (kept, planned)
    stager.close()


def test_a_gpu_plan_leaves_host_memory_out_and_a_cpu_plan_counts_it():
    gpu = PlanInput(mode="dhp", num_classes=1_281_167, ranks=2, batch=96, backbone="resnet18", runtime_bytes=10**9,
                    checkpoints=True)
    assert not [name for name in predict(gpu) if "checkpoint" in name or "runtime" in name]
    cpu = predict(PlanInput(**{**gpu.__dict__, "device": "cpu"}))
    assert cpu["runtime (measured: Python, torch, libs)"] == 10**9
    assert cpu["checkpoint copies: classifier rows"] == 2 * 640_584 * 128 * 4  # W and momentum of 640,584 rows
    assert cpu["checkpoint copies: DeepSpeed files"] > 0 and cpu["checkpoint copies: model.pt, optimizer.pt"] > 0
    unsaved = predict(PlanInput(**{**gpu.__dict__, "device": "cpu", "checkpoints": False}))
    assert not [name for name in unsaved if "checkpoint" in name]


def test_plan_cpu_shows_the_measured_runtime_as_a_line_of_its_own(tmp_path, capsys, monkeypatch):
    from trainer.cli import main

    measured = []
    monkeypatch.setattr(runtime_baseline, "runtime_rss_bytes", lambda dali: measured.append(dali) or 1100 * MIB)
    path = tmp_path / "plan.json"
    assert main(["plan", "--num-classes", "1281167", "--ranks", "2", "--batch", "96", "--backbone", "resnet10",
                 "--cpu", "--no-dali", "--json", str(path)]) == 0
    assert measured == [False]
    line = next(line for line in capsys.readouterr().out.splitlines() if "runtime (measured" in line)
    assert line.split()[-2] == f"{1100 * MIB / 2**30:.3f}"
    breakdown = json.loads(path.read_text())["dhp"]["breakdown"]
    assert breakdown["runtime (measured: Python, torch, libs)"] == 1100 * MIB


@pytest.mark.slow  # default suite: the runtime's line in test_plan_cpu_shows_the_measured_runtime_as_a_line_of_its_own
@pytest.mark.integration
def test_the_runtime_is_measured_in_a_fresh_process_importing_what_a_rank_imports():
    runtime_baseline.runtime_rss_bytes.cache_clear()
    without_dali, with_dali = runtime_baseline.runtime_rss_bytes(False), runtime_baseline.runtime_rss_bytes(True)
    assert 200 * MIB < without_dali <= with_dali < 4096 * MIB, (without_dali, with_dali)
