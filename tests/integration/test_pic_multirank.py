"""PIC on gloo ranks against independent float64 references.

* One sampled step at T = 1, 2, 3: loss and gradients equal ``F.cross_entropy`` on the full matrix
  restricted to the sampled columns (the batch plus the recent ids); with ``negatives: all``, on
  the full matrix.
* The heart of PIC: hundreds of steps of sampling + lazy correction (warm-up + cosine, momentum,
  weight decay, rows untouched for thousands of steps, prefetch on) through a checkpoint and two
  reshards (2 -> 1 -> 2 ranks) give the W and momentum of dense SGD in which unsampled rows get a
  zero gradient.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from data_pipeline.loading.samplers.base import StepIndices
from data_pipeline.loading.view_layout import ViewLayout
from trainer.checkpoint.components import load_component, save_component
from trainer.checkpoint.row_checkpoint import read_full_rows
from trainer.classifier.sharded_classifier import gaussian_rows
from trainer.engine.schedule import LRSchedule, set_lr
from trainer.objectives import ObjectiveContext, OptimSettings, PicConfig, StepViews, View, build_objective
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

DIM, TAU, SEED, INIT_STD = 8, 0.2, 5, 1.0
MOMENTUM, WEIGHT_DECAY = 0.9, 5e-3  # a large decay so that skipped steps move rows visibly


def _objective(dims, num_instances, queue_size, views=2, **overrides):
    config = PicConfig(temperature=TAU, chunk_size=3, queue_size=queue_size, init_std=INIT_STD, row_dtype="float64",
                       **overrides)
    context = ObjectiveContext(dims=dims, num_instances=num_instances, feature_dim=DIM, seed=SEED,
                               optim=OptimSettings(momentum=MOMENTUM, weight_decay=WEIGHT_DECAY),
                               views=ViewLayout(("global",) * views, (32,) * views))
    return build_objective(config, context)


def _indices(ids: np.ndarray, world: int) -> StepIndices:
    ids = ids.reshape(world, -1)
    return StepIndices(ids=ids, valid=np.ones_like(ids, dtype=bool))


def _run_step(objective, dims, step, lr, ids, features, next_ids=None):
    """One trainer step: ``ids [B]`` and ``features [views, B, D]`` are the global batch."""
    world, local = dims.world_size, ids.size // dims.world_size
    mine = slice(dims.rank * local, (dims.rank + 1) * local)
    views = [View(features[v, mine].clone().requires_grad_(), "global", v) for v in range(features.shape[0])]
    optimizer, = objective.optimizers()
    set_lr(optimizer, lr)
    step_views = StepViews(views, torch.from_numpy(ids[mine]), torch.ones(local, dtype=torch.bool), ids.size, 0, step,
                           plan=_indices(ids, world),
                           next_plan=None if next_ids is None else _indices(next_ids, world))
    loss = objective.loss(step_views).loss
    loss.backward()
    objective.after_backward()
    leaf_grad = optimizer.pending_leaf.grad.clone()
    optimizer.step()
    optimizer.zero_grad()
    return loss, views, leaf_grad


def _reference_sampled_loss(weight, features, ids, sampled):
    """Mean over views and samples of the cross entropy over the sampled columns only."""
    columns = torch.from_numpy(sampled)
    targets = torch.from_numpy(np.searchsorted(sampled, ids))
    logits = torch.cat([F.normalize(f, dim=1) for f in features]) @ F.normalize(weight[columns], dim=1).t() / TAU
    return F.cross_entropy(logits, targets.repeat(features.shape[0]))


# -- one sampled step against the restricted full matrix -----------------------------------------

N_SMALL, QUEUE_SMALL, BATCH_SMALL = 41, 7, 6


def _small_batches(steps):
    generator = np.random.default_rng(11)
    ids = [generator.choice(N_SMALL, BATCH_SMALL, replace=False) for _ in range(steps)]
    features = [torch.from_numpy(generator.normal(size=(2, BATCH_SMALL, DIM))) for _ in range(steps)]
    return ids, features


def _check_one_sampled_step(negatives: str):
    dims = init_distributed()
    objective = _objective(dims, N_SMALL, QUEUE_SMALL, prefetch=False, negatives=negatives)
    ids, features = _small_batches(3)
    for step in range(2):  # lr 0: W stays at its initial rows, the queue fills
        _run_step(objective, dims, step, 0.0, ids[step], features[step].float())
    loss, views, leaf_grad = _run_step(objective, dims, 2, 0.0, ids[2], features[2].float())

    queue = np.concatenate(ids[:2])[-QUEUE_SMALL:]
    sampled = np.union1d(queue, ids[2]) if negatives == "recent" else np.arange(N_SMALL)
    weight = gaussian_rows(0, N_SMALL, DIM, INIT_STD, SEED).double().requires_grad_()
    feats = features[2].clone().requires_grad_()
    reference = _reference_sampled_loss(weight, feats, ids[2], sampled)
    reference.backward()

    size, label = dims.world_size, f"T={dims.world_size} rank {dims.rank}"
    torch.testing.assert_close(loss.detach().double(), reference.detach(), rtol=1e-6, atol=1e-6, msg=label)
    local = BATCH_SMALL // size
    mine = slice(dims.rank * local, (dims.rank + 1) * local)
    for view in views:  # features feed the whole group: their gradient is scaled by T for the average
        torch.testing.assert_close(view.features.grad.double() / size, feats.grad[view.index, mine],
                                   rtol=0, atol=1e-6, msg=label)
    shard = objective.shard
    owned = sampled[(sampled >= shard.class_start) & (sampled < shard.class_end)]
    torch.testing.assert_close(leaf_grad.double(), weight.grad[torch.from_numpy(owned)], rtol=0, atol=1e-6, msg=label)


@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow),
                                   3])  # 3: uneven shards
def test_sampled_step_equals_cross_entropy_on_the_sampled_columns(ranks):
    spawn_local_workers(_check_one_sampled_step, ranks, "recent")


def test_without_sampling_the_step_is_the_full_softmax():
    spawn_local_workers(_check_one_sampled_step, 2, "all")


def _check_padded_step(co2_alpha: float):
    """The last batch of an epoch pads with repeats of earlier ids (valid False).  With recent
    negatives a repeat's own row is not among the sampled columns, so it has no target: it must
    add nothing to the loss or any gradient (it once made the loss inf * 0 = NaN and stopped runs
    in epoch order at the epoch's end)."""
    dims = init_distributed()
    objective = _objective(dims, N_SMALL, 0, prefetch=False, co2_alpha=co2_alpha)  # no queue: valid ids only
    generator = np.random.default_rng(12)
    ids = generator.choice(N_SMALL, BATCH_SMALL, replace=False)  # the padded ids appear nowhere else
    valid = np.ones(BATCH_SMALL, dtype=bool)
    valid[-2:] = False
    features = torch.from_numpy(generator.normal(size=(2, BATCH_SMALL, DIM))).float()
    world, local = dims.world_size, BATCH_SMALL // dims.world_size
    mine = slice(dims.rank * local, (dims.rank + 1) * local)
    views = [View(features[v, mine].clone().requires_grad_(), "global", v) for v in range(2)]
    optimizer, = objective.optimizers()
    set_lr(optimizer, 0.0)
    batch = StepIndices(ids=ids.reshape(world, -1), valid=valid.reshape(world, -1))
    step = StepViews(views, torch.from_numpy(ids[mine]), torch.from_numpy(valid[mine]), int(valid.sum()), 0, 0,
                     plan=batch)
    loss = objective.loss(step).loss
    loss.backward()
    objective.after_backward()
    leaf_grad = optimizer.pending_leaf.grad.clone()
    optimizer.step()

    label = f"T={world} rank {dims.rank} co2_alpha={co2_alpha}"
    assert torch.isfinite(loss) and all(torch.isfinite(v.features.grad).all() for v in views), label
    for view in views:  # the padding repeats get no gradient at all
        assert not view.features.grad[torch.from_numpy(~valid[mine])].any(), label
    if co2_alpha == 0:  # the valid samples alone, against the reference over the valid ids' columns
        weight = gaussian_rows(0, N_SMALL, DIM, INIT_STD, SEED).double().requires_grad_()
        feats = features.double().clone().requires_grad_()
        sampled = np.sort(ids[valid])
        reference = _reference_sampled_loss(weight, feats[:, torch.from_numpy(valid)], ids[valid], sampled)
        reference.backward()
        torch.testing.assert_close(loss.detach().double(), reference.detach(), rtol=1e-6, atol=1e-6, msg=label)
        for view in views:
            torch.testing.assert_close(view.features.grad.double() / world, feats.grad[view.index, mine],
                                       rtol=0, atol=1e-6, msg=label)
        shard = objective.shard
        owned = sampled[(sampled >= shard.class_start) & (sampled < shard.class_end)]
        torch.testing.assert_close(leaf_grad.double(), weight.grad[torch.from_numpy(owned)], rtol=0, atol=1e-6,
                                   msg=label)


@pytest.mark.parametrize("co2_alpha", [0.0, pytest.param(0.3, marks=pytest.mark.slow)])
def test_padding_repeats_without_a_sampled_row_add_nothing(co2_alpha):
    spawn_local_workers(_check_padded_step, 2, co2_alpha)


# -- lazy correction against dense SGD across a checkpoint and two reshards ----------------------

# 150 steps: with the large decay the skipped rows still move well past the floor checked below.
N_LONG, QUEUE_LONG, BATCH_LONG, STEPS = 48, 4, 4, 150
PHASES = [(2, 0, 50), (1, 50, 100), (2, 100, 150)]  # (ranks, first step, end)
RARE = np.arange(8)  # sampled in the first and last two steps only: ~150 skipped steps


def _long_schedule():
    return LRSchedule(peak_lr=0.5, warmup_steps=15, total_steps=STEPS, min_lr=0.0)


def _long_batch(step):
    generator = np.random.default_rng([3, step])
    if step < 2 or step >= STEPS - 2:
        ids = generator.choice(RARE, BATCH_LONG, replace=False)
    else:
        ids = generator.choice(np.arange(len(RARE), N_LONG), BATCH_LONG, replace=False)
    return ids, torch.from_numpy(generator.normal(size=(1, BATCH_LONG, DIM))).float()


def _long_phase(folder: str, first: int, end: int):
    dims = init_distributed()
    objective = _objective(dims, N_LONG, QUEUE_LONG, views=1)
    if first:
        load_component(Path(folder, f"step{first}"), "objective", objective, dims, dims.device)
    schedule = _long_schedule()
    for step in range(first, end):
        ids, features = _long_batch(step)
        next_ids = _long_batch(step + 1)[0] if step + 1 < end else None
        _run_step(objective, dims, step, schedule.lr_at(step), ids, features, next_ids)
    out = Path(folder, f"step{end}")
    if dims.rank == 0:
        (out / "components" / "objective").mkdir(parents=True)
    dist.barrier()
    save_component(out, "objective", objective, dims)
    dist.barrier()


def _saved_rows(folder: Path, key: str) -> torch.Tensor:
    return read_full_rows(folder / "components" / "objective" / "rows")[key]


def test_lazy_correction_equals_dense_sgd_across_resume_and_reshards(tmp_path):
    for ranks, first, end in PHASES:
        spawn_local_workers(_long_phase, ranks, str(tmp_path), first, end)

    weight = gaussian_rows(0, N_LONG, DIM, INIT_STD, SEED).double().requires_grad_()
    dense = torch.optim.SGD([weight], lr=0.0, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    schedule, queue = _long_schedule(), deque(maxlen=QUEUE_LONG)
    for step in range(STEPS):
        ids, features = _long_batch(step)
        sampled = np.union1d(np.array(queue, dtype=np.int64), ids)
        dense.zero_grad()
        _reference_sampled_loss(weight, features.double(), ids, sampled).backward()  # zero outside `sampled`
        dense.param_groups[0]["lr"] = schedule.lr_at(step)
        dense.step()
        queue.extend(ids.tolist())

    final = tmp_path / f"step{STEPS}"
    saved = _saved_rows(final, "rows")  # [N, 2, D]: W and momentum side by side
    got_weight, got_momentum = saved[:, 0], saved[:, 1]
    expected_momentum = dense.state[weight]["momentum_buffer"]
    relative = lambda got, want: float((got - want).norm() / want.norm())  # noqa: E731
    assert relative(got_weight, weight.detach()) <= 1e-6
    assert relative(got_momentum, expected_momentum) <= 1e-6
    # Per row too, including the rows skipped for ~150 steps, which decay and momentum moved.
    for row in range(N_LONG):
        assert relative(got_weight[row], weight.detach()[row]) <= 1e-6, row
    initial = gaussian_rows(0, N_LONG, DIM, INIT_STD, SEED).double()
    assert (got_weight[RARE] - initial[RARE]).norm() > 0.1 * initial[RARE].norm()
