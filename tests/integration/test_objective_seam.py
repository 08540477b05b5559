"""The objective seam: a method written entirely in this file trains through the real trainer,
checkpoints and resumes bit-identically, without touching any file outside the test.

The toy method is a plain replicated linear classifier over instance ids (softmax over N logits),
its gradient averaged over the ranks the way DDP would, trained by its own SGD on the trainer's
schedule.  The trainer runs in spawned ranks (gloo) so that the registration below is visible to it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.training import FAST, REPO
from trainer.checkpoint.row_checkpoint import read_full_rows
from trainer.objectives import (
    LossOut,
    Objective,
    ObjectiveConfig,
    ShardedRows,
    average_gradients,
    register_objective,
)
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class LinearConfig(ObjectiveConfig):
    """Attributes: name: "toy_linear"; temperature: logits are divided by it."""

    name: str = "toy_linear"
    temperature: float = 0.5

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} is invalid: use a positive number")


class LinearObjective(Objective):
    def __init__(self, config: LinearConfig, context) -> None:
        super().__init__(config, context)
        generator = torch.Generator().manual_seed(context.seed)
        self.fc = nn.Linear(context.feature_dim, context.num_instances, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(self.fc.weight.shape, generator=generator) * 0.01)
        self.fc.to(context.dims.device)
        self.sgd = torch.optim.SGD(self.fc.parameters(), lr=0.0, momentum=context.optim.momentum,
                                   weight_decay=context.optim.weight_decay)
        self.steps_seen = 0

    def optimizers(self):
        return [self.sgd]

    def loss(self, step) -> LossOut:
        views = len(step.views)
        logits = self.fc(torch.cat([F.normalize(v.features.float(), dim=1) for v in step.views]))
        per_sample = F.cross_entropy(logits / self.config.temperature, step.instance_ids.repeat(views),
                                     reduction="none")
        self.steps_seen += 1
        share = self.context.dims.world_size / (step.global_valid * views)  # the global valid mean, once averaged
        return LossOut((per_sample * step.valid.repeat(views)).sum() * share)

    def after_backward(self) -> None:
        average_gradients(self.fc.parameters(), self.context.dims)

    def metrics(self):
        return {"steps_seen": float(self.steps_seen)}

    def state_dict(self):
        weight = self.fc.weight.detach()
        momentum = self.sgd.state.get(self.fc.weight, {}).get("momentum_buffer")
        primary = self.context.dims.rank == 0  # replicated: one copy is enough
        rows = ShardedRows(weight, 0, weight.shape[0], weight.shape[0], primary)
        return {"weight": rows, "momentum": ShardedRows(momentum, 0, weight.shape[0], weight.shape[0], primary),
                "steps_seen": self.steps_seen}

    def load_state_dict(self, state) -> None:
        with torch.no_grad():
            self.fc.weight.copy_(state["weight"].rows)
        if state["momentum"].rows is not None:
            self.sgd.state[self.fc.weight]["momentum_buffer"] = state["momentum"].rows.clone()
        self.steps_seen = state["steps_seen"]


def _train(run_dir: str, shards: dict, overrides: list[str], resume: str) -> None:
    from trainer.config import load_job_config
    from trainer.engine.trainer import Trainer
    from trainer.parallel import init_distributed

    register_objective("toy_linear", LinearConfig, LinearObjective)
    settings = [f"data.train_shards={shards['train']}", f"checkpoint.dir={run_dir}/checkpoints",
                f"logging.dir={run_dir}/logs", "logging.progress=false", "logging.metrics_port=0",
                "eval.knn_at_end=false", "checkpoint.every_epochs=0", "objective={name: toy_linear}", *FAST,
                *overrides]
    config = load_job_config(REPO / "configs" / "digits_cpu.yaml", settings)
    Trainer(config, init_distributed(), resume=resume).train()


def _checkpoint_state(run_dir):
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*[0-9]"))[-1]
    objective = torch.load(checkpoint / "components" / "objective" / "rank-00000.pt", weights_only=True)
    for key, rows in read_full_rows(checkpoint / "components" / "objective" / "rows").items():
        objective[key]["rows"] = rows  # the row-sharded state, whole
    model = torch.load(checkpoint / "model.pt", weights_only=True)
    return checkpoint, objective, model


def test_a_toy_objective_trains_checkpoints_and_resumes_exactly(tiny_digits_split, tmp_path):
    """128 digits in batches of 2 x 32: 2 steps an epoch, so the resume at step 3 is mid-epoch.  The
    uninterrupted run saves at step 3 on its way; another run resumes from that checkpoint alone."""
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"
    small = ["data.loader.batch_size=32", "checkpoint.every_steps=3", "logging.log_every=1"]
    spawn_local_workers(_train, 2, str(uninterrupted), tiny_digits_split, [*small, "max_steps=6"], "none")
    shutil.copytree(uninterrupted / "checkpoints" / "step_000000003", interrupted / "checkpoints" / "step_000000003")
    spawn_local_workers(_train, 2, str(interrupted), tiny_digits_split, [*small, "max_steps=6"], "auto")

    resumed, objective_a, model_a = _checkpoint_state(interrupted)
    reference, objective_b, model_b = _checkpoint_state(uninterrupted)
    assert resumed.name == reference.name == "step_000000006"
    assert objective_a["steps_seen"] == objective_b["steps_seen"] == 6
    assert torch.equal(objective_a["weight"]["rows"], objective_b["weight"]["rows"])
    assert torch.equal(objective_a["momentum"]["rows"], objective_b["momentum"]["rows"])
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key
    initial = torch.randn(objective_a["weight"]["rows"].shape, generator=torch.Generator().manual_seed(0)) * 0.01
    assert not torch.allclose(objective_a["weight"]["rows"], initial), "the toy classifier never trained"
    log = [json.loads(line) for line in (uninterrupted / "logs" / "rank-00000.jsonl").read_text().splitlines()]
    assert any("objective_steps_seen" in entry for entry in log if entry["event"] == "step")
    resumed_log = [json.loads(line) for line in (interrupted / "logs" / "rank-00000.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in resumed_log if entry["event"] == "step"] == [4, 5, 6]  # it resumed at 3
