"""The kernel's term seam: a term written entirely in this file plugs into the sharded kernel and
trains through the real trainer, without touching any file outside the test.

The toy term is each sample's mean logit over the scored rows, ``T_i = mean_j z_ij`` with
``z = cos / tau``: a push away from the average row when added to the loss.  It needs two column
sums per sample (the logits' and the rows'), which ride in the kernel's SUM all-reduce.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.training import FAST, REPO, classifier_rows, latest_checkpoint
from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce_with_term
from trainer.classifier.kernel.reductions import SampleColumns
from trainer.classifier.terms.chunk_term import KernelPass
from trainer.objectives import InstanceConfig, register_objective
from trainer.objectives.instance.objective import InstanceObjective
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

LOG2_E = math.log2(math.e)


class MeanLogitForward:
    def __init__(self, term: MeanLogitTerm, kernel_pass: KernelPass) -> None:
        self.term = term
        self.logit_sum = torch.zeros(kernel_pass.batch, device=kernel_pass.own_row.device)
        self.rows = torch.zeros_like(self.logit_sum)

    def add_chunk(self, kernel_sum, logits, chunk):
        self.logit_sum += logits.sum(dim=0) / LOG2_E  # base-2 logits back to z
        self.rows += logits.shape[0]
        return kernel_sum + torch.exp2(logits).sum(dim=0)

    def columns(self) -> SampleColumns:
        return SampleColumns(sums={"toy_logit_sum": self.logit_sum, "toy_rows": self.rows})

    def finish(self, reduced):
        values = reduced["toy_logit_sum"] / reduced["toy_rows"]
        self.term.last_mean = float(values.mean())
        return values, reduced["toy_rows"]


class MeanLogitBackward:
    def __init__(self, grad_term, column_signs, shift_base2, rows) -> None:
        # dT_i/dz_ij = 1 / rows_i; the kernel flips whole columns by their sign afterwards: undo it.
        self.per_row = grad_term.float() * column_signs / rows
        self.shift_base2 = shift_base2

    def grad_logits(self, logits, chunk):
        return torch.exp2(logits - self.shift_base2) + self.per_row


class MeanLogitTerm:
    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.last_mean = float("nan")

    def start_forward(self, kernel_pass):
        return MeanLogitForward(self, kernel_pass)

    def start_backward(self, kernel_pass, saved, grad_term, column_signs, shift_base2):
        return MeanLogitBackward(grad_term, column_signs, shift_base2, saved)


def test_the_toy_term_matches_a_float64_reference():
    generator = torch.Generator().manual_seed(0)
    batch, rows, dim, tau = 6, 11, 5, 0.2
    features = F.normalize(torch.randn(batch, dim, generator=generator), dim=1)
    weight = torch.randn(rows, dim, generator=generator)
    targets = torch.tensor([3, 0, 10, 7, 3, 5])
    upstream = torch.rand(batch, generator=generator) * 2 - 1  # negative: the kernel's column flips

    x, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
    settings = KernelSettings(temperature=tau, chunk_size=4)  # 11 rows: chunks of 4, 4, 3
    loss, term = sharded_cosine_ce_with_term(x, w, targets[:, None], torch.ones(batch, 1), settings,
                                             MeanLogitTerm(1.0), None)
    ((loss * upstream).sum() + (term * upstream.flip(0)).sum()).backward()

    x64, w64 = features.double().requires_grad_(), weight.double().requires_grad_()
    logits = x64 @ F.normalize(w64, dim=1).t() / tau
    loss64 = F.cross_entropy(logits, targets, reduction="none")
    term64 = logits.mean(dim=1)
    ((loss64 * upstream.double()).sum() + (term64 * upstream.flip(0).double()).sum()).backward()

    torch.testing.assert_close(loss.double(), loss64.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(term.double(), term64.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=1e-5, rtol=1e-5)


@dataclass(frozen=True)
class MeanLogitInstanceConfig(InstanceConfig):
    """``instance`` with the toy term added to its loss at ``toy_weight``."""

    name: str = "toy_term_instance"
    toy_weight: float = 0.5

    def term(self, views):
        return MeanLogitTerm(self.toy_weight)


class MeanLogitInstance(InstanceObjective):
    def metrics(self):
        return {**super().metrics(), "toy_term_mean": self.classifier.head.term.last_mean}


def _train(run_dir: str, shards: dict, objective: str) -> None:
    from trainer.config import load_job_config
    from trainer.engine.trainer import Trainer
    from trainer.parallel import init_distributed

    register_objective("toy_term_instance", MeanLogitInstanceConfig, MeanLogitInstance)
    settings = [f"data.train_shards={shards['train']}", f"checkpoint.dir={run_dir}/checkpoints",
                f"logging.dir={run_dir}/logs", "logging.progress=false", "logging.metrics_port=0",
                "logging.log_every=1", "eval.knn_at_end=false", "checkpoint.every_epochs=0", "max_steps=3",
                f"objective={{name: {objective}, contrastive_prior: false, smoothing_alpha: 0}}", *FAST]
    config = load_job_config(REPO / "configs" / "digits_cpu.yaml", settings)
    Trainer(config, init_distributed(), resume="none").train()


def _steps(run_dir) -> list[dict]:
    lines = (run_dir / "logs" / "rank-00000.jsonl").read_text().splitlines()
    return [entry for entry in map(json.loads, lines) if entry["event"] == "step"]


@pytest.mark.slow  # default suite: the toy term against float64 below; the trainer's seam: test_objective_seam.py
def test_a_toy_term_trains_through_the_real_trainer(digits_split, tmp_path):
    spawn_local_workers(_train, 2, str(tmp_path / "toy"), digits_split, "toy_term_instance")
    spawn_local_workers(_train, 2, str(tmp_path / "plain"), digits_split, "instance")
    toy, plain = _steps(tmp_path / "toy"), _steps(tmp_path / "plain")
    assert len(toy) == len(plain) == 3
    # The first step starts from the same network and batch: the term is all that differs.
    mean = toy[0]["objective_toy_term_mean"]
    assert abs(mean) > 1e-3
    assert abs(toy[0]["loss"] - (plain[0]["loss"] + 0.5 * mean)) < 5e-5
    # Its gradient reached the update: the classifier rows differ after the three steps.
    toy_rows = classifier_rows(latest_checkpoint(tmp_path / "toy"))["weight"]
    plain_rows = classifier_rows(latest_checkpoint(tmp_path / "plain"))["weight"]
    assert toy_rows.shape == plain_rows.shape and not torch.equal(toy_rows, plain_rows)
