"""Lazy SGD on sampled rows (through a working set and a row store) against dense torch SGD in
which unsampled rows get a zero gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.engine.schedule import LRSchedule
from trainer.objectives.pic.lazy_sgd import LazyRowSGD
from trainer.objectives.pic.row_store import make_row_store
from trainer.objectives.pic.skipped_steps_sgd import StepTransitions
from trainer.objectives.pic.working_set import WorkingSet


def _schedule(steps: int) -> LRSchedule:
    return LRSchedule(peak_lr=0.8, warmup_steps=steps // 10, total_steps=steps, min_lr=0.001)


def test_segment_tree_equals_the_ordered_product():
    rng = np.random.default_rng(0)
    transitions = StepTransitions(momentum=0.9, weight_decay=1e-2, base=7, capacity=4)  # grows several times
    lrs = rng.uniform(0.01, 1.0, size=300)
    for offset, lr in enumerate(lrs):
        transitions.push(7 + offset, lr)
    firsts = np.array([7, 8, 100, 306, 307, 150, 7])
    ends = [307, 307, 307, 307, 307, 151, 7]
    for first, end in zip(firsts, ends):
        expected = np.eye(2)
        for step in range(first, end):
            expected = transitions.matrix(lrs[step - 7]) @ expected
        got = transitions.between(np.array([first]), end)[0]
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="not all recorded"):
        transitions.between(np.array([3]), 10)
    with pytest.raises(ValueError, match="out of order"):
        transitions.push(400, 0.1)


@pytest.mark.parametrize("kind", ["device", "host", "disk"])
def test_lazy_rows_equal_dense_sgd_over_warmup_and_cosine_and_dropped_steps(kind, tmp_path):
    rows, dim, steps = 40, 6, 3000
    momentum, weight_decay = 0.9, 5e-3  # a large decay makes skipped steps matter
    rng = np.random.default_rng(1)
    initial = torch.from_numpy(rng.normal(size=(rows, dim)))
    schedule = _schedule(steps)
    dropped = {3, 1000, 1001, 2500}  # non-finite steps (optim.on_nonfinite: skip_step), rows 0-4 in none

    dense = initial.clone().requires_grad_(True)
    reference = torch.optim.SGD([dense], lr=0.0, momentum=momentum, weight_decay=weight_decay)
    store = make_row_store(kind, rows, dim, torch.float64, torch.device("cpu"), tmp_path / "rows")
    store.fill(lambda a, b: initial[a:b], None, 0)
    lazy = LazyRowSGD(momentum, weight_decay)
    working = WorkingSet(store, lazy)

    for step in range(steps):
        lr = schedule.lr_at(step)
        # Rows 0-4 are sampled at the first and last steps only: thousands of skipped steps.
        if step < 2 or step >= steps - 2:
            sampled = np.arange(0, 8)
        else:
            sampled = np.sort(rng.choice(np.arange(5, rows), size=6, replace=False))
        grad = torch.from_numpy(rng.normal(size=(sampled.size, dim)))
        weight, mom = working.gather(sampled, step)
        lazy.param_groups[0]["lr"] = lr
        leaf = weight.clone().requires_grad_(True)
        leaf.grad = grad
        lazy.set_pending(weight, mom, leaf, step)
        if step in dropped:  # skip_step: dense SGD does not step at all, and no row may move
            assert lazy.skip() == step
            working.stepped(step)
            continue
        full_grad = torch.zeros(rows, dim, dtype=torch.float64)
        full_grad[sampled] = grad
        dense.grad = full_grad
        reference.param_groups[0]["lr"] = lr
        reference.step()
        lazy.step()
        working.stepped(step)
        if step == steps // 2:  # a checkpoint in the middle: every row brought to this step
            working.materialize(step + 1)

    working.materialize(steps)
    expected_momentum = reference.state[dense]["momentum_buffer"]
    assert (store.last_step == steps).all()
    torch.testing.assert_close(store.weight, dense.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(store.momentum, expected_momentum, rtol=1e-9, atol=1e-12)
    # the untouched rows moved: the correction is not a no-op
    assert not torch.allclose(store.weight[10], initial[10])


def test_disk_store_refuses_a_disk_too_small(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10, 10, 1000))
    with pytest.raises(OSError, match="row_store_dir=.*needs"):
        make_row_store("disk", 1000, 128, torch.float32, torch.device("cpu"), tmp_path)
