"""Bit-identical runs on GPU hosts.  The kernel's row adds avoid CUDA's atomic
``scatter_add_``/``index_add_`` (faked here: the CUDA path is forced on CPU tensors and the atomic
ops raise), and ``parallel.deterministic`` turns on torch's deterministic mode before CUDA work."""

import os

import pytest
import torch

from tests.unit.test_kernel import TAU, problem, run_kernel, subset_rows
from trainer.classifier.in_backward_sgd import InBackwardSGD
from trainer.classifier.kernel import row_adds
from trainer.classifier.kernel.chunked import KernelSettings
from trainer.config import ParallelSection
from trainer.config_building import ConfigError
from trainer.parallel import determinism


def _forbid_atomic_adds(monkeypatch):
    """The CUDA path on CPU tensors, with CUDA's non-deterministic ops refused."""
    monkeypatch.setattr(row_adds, "_atomic", lambda tensor: True)

    def refuse(*args, **kwargs):
        raise AssertionError("an atomic (run-to-run non-deterministic on CUDA) add was used")

    monkeypatch.setattr(torch.Tensor, "scatter_add_", refuse)
    monkeypatch.setattr(torch.Tensor, "index_add_", refuse)


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
@pytest.mark.parametrize("rows_kind", ["all", "sampled"])
def test_the_cuda_path_of_the_backward_uses_no_atomic_adds_and_gives_the_same_bits(monkeypatch, rows_kind,
                                                                                  cache_bytes):
    rows, row_index = subset_rows(rows_kind)
    features, weight, _, _, targets, weights = problem(row_index.numel(), 0.2)
    settings = KernelSettings(temperature=TAU, chunk_size=6, logits_cache_bytes=cache_bytes)
    reference = run_kernel(features, weight, targets, weights, settings, rows)

    _forbid_atomic_adds(monkeypatch)
    first = run_kernel(features, weight, targets, weights, settings, rows)
    second = run_kernel(features, weight, targets, weights, settings, rows)
    for mine, again, theirs in zip(first, second, reference):
        assert torch.equal(mine, again) and torch.equal(mine, theirs)


def test_the_cuda_path_of_in_backward_sgd_uses_no_atomic_adds(monkeypatch):
    rows, row_index = subset_rows("sampled")
    features, weight, _, _, targets, weights = problem(row_index.numel(), 0.2)
    settings = KernelSettings(temperature=TAU, chunk_size=6)

    def updated_weight():
        parameter = torch.nn.Parameter(weight.clone())
        update = InBackwardSGD(parameter, lr=0.5, momentum=0.9, weight_decay=1e-4)
        for _ in range(2):  # the second step reads the momentum the first wrote
            update.apply_rows(rows, torch.linspace(-1, 1, rows.numel() * weight.shape[1]).view(rows.numel(), -1))
        return parameter.detach()

    reference = updated_weight()
    _forbid_atomic_adds(monkeypatch)
    assert torch.equal(updated_weight(), reference)
    run_kernel(features, weight, targets, weights, settings, rows,
               update=InBackwardSGD(torch.nn.Parameter(weight.clone()), lr=0.1))


def test_repeated_rows_still_get_every_contribution(monkeypatch):
    monkeypatch.setattr(row_adds, "_atomic", lambda tensor: True)
    rows = torch.tensor([[0, 2, 2], [2, 0, 1]])  # column 1: row 0 twice; column 2: rows 2 and 1
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out = torch.zeros(3, 3)
    row_adds.add_into_rows(out, rows, values)
    assert torch.equal(out, torch.zeros(3, 3).scatter_add_(0, rows, values))
    repeated = torch.tensor([1, 1, 0])
    out = torch.zeros(2, 2)
    row_adds.add_rows(out, repeated, torch.ones(3, 2), alpha=-2.0)
    assert torch.equal(out, torch.tensor([[-2.0, -2.0], [-4.0, -4.0]]))


def test_the_switch_turns_on_deterministic_mode_and_the_cublas_workspace(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, warn_only=False: calls.append(
        (mode, warn_only)))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    determinism.apply_determinism(False)
    assert calls == [] and "CUBLAS_WORKSPACE_CONFIG" not in os.environ

    determinism.apply_determinism(True)
    assert calls == [(True, False)]
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.deterministic is True


def test_train_applies_the_switch_before_joining_the_job(monkeypatch, tmp_path):
    """`instcls train` reads parallel.deterministic and applies it before init_distributed."""
    import trainer.parallel as parallel
    from trainer.cli import main

    order = []
    monkeypatch.setattr(determinism, "apply_determinism", lambda enabled: order.append(("determinism", enabled)))

    def stop(*args, **kwargs):
        order.append(("init_distributed",))
        raise SystemExit(0)

    monkeypatch.setattr(parallel, "init_distributed", stop)
    with pytest.raises(SystemExit):
        main(["train", "--config", "configs/digits_cpu.yaml", "--set", f"data.train_shards={tmp_path}",
              "--set", "parallel.deterministic=true"])
    assert order == [("determinism", True), ("init_distributed",)]


def test_the_drills_and_the_resume_tests_run_deterministically():
    from tests.helpers.training import FAST
    from trainer.drills.context import CADENCE

    assert "parallel.deterministic=true" in CADENCE and "parallel.deterministic=true" in FAST


def test_the_switch_is_a_bool():
    assert ParallelSection().deterministic is False
    with pytest.raises(ConfigError, match="parallel.deterministic"):
        ParallelSection(deterministic="yes")
