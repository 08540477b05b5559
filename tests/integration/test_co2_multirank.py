"""CO2's consistency term fused into the sharded kernel, on gloo ranks, against float64 references
that build the full distributions over the other rows with ``torch.softmax`` and ``F.kl_div``
(``tests.helpers.reference``): the kernel at T = 1, 2, 3 (chunks that do not divide the shard, label
smoothing on and off, the logits cache, sampled rows), the instance classifier's total loss with
padding, and a ``pic`` step over its sampled rows.  The term adds no collective.

The chunk math runs eagerly here (``compiled=False``): what is checked is the distributed math, and
inductor's compilation of the same functions is checked against the eager code on its own
(tests/unit/test_co2_kernel.py), where it costs one process's compile instead of every rank's."""

from __future__ import annotations

import functools
import itertools
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from data_pipeline.loading.samplers.base import StepIndices
from data_pipeline.loading.view_layout import ViewLayout
from tests.helpers.reference import random_hard_negatives, reference_co2_pairs, reference_co2_per_view, reference_loss
from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce_with_term
from trainer.classifier.sharded_classifier import gaussian_rows
from trainer.classifier.terms.co2 import ConsistencySettings, ConsistencyTerm
from trainer.engine.schedule import set_lr
from trainer.objectives import ObjectiveContext, OptimSettings, PicConfig, StepViews, View, build_objective
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

NUM_ROWS, DIM, LOCAL, TOP_K, TAU, TAU_CON = 37, 8, 3, 4, 0.15, 0.05


def _kernel_columns(views: int, world: int):
    """``(view, image)`` of each kernel column: all-gather order, rank by rank, each rank's views in turn."""
    columns = [(v, r * LOCAL + i) for r in range(world) for v in range(views) for i in range(LOCAL)]
    return torch.tensor([c[0] for c in columns]), torch.tensor([c[1] for c in columns])


def _scored_rows(rank, world, sampled):
    shard = torch.arange(NUM_ROWS).tensor_split(world)[rank]
    return shard[::2] if sampled else shard


def _check_kernel(views: int, global_views: int):
    dims = init_distributed()
    rank, world, group = dims.rank, dims.world_size, dims.classifier_group
    generator = torch.Generator().manual_seed(9)
    images = LOCAL * world
    features = torch.randn(views, images, DIM, generator=generator)
    weight = torch.randn(NUM_ROWS, DIM, generator=generator)
    view_of, image_of = _kernel_columns(views, world)
    batch = view_of.numel()
    # Upstream gradients of both outputs, negative ones included (the kernel flips such columns).
    grad_loss = torch.rand(batch, generator=generator, dtype=torch.float64) * 2 - 1
    grad_term = torch.rand(batch, generator=generator, dtype=torch.float64) * 2 - 1
    term_in_kernel = ConsistencyTerm(ConsistencySettings(TAU_CON, views, global_views, compiled=False))
    for smoothing, cache, chunk, sampled in itertools.product([0.0, 0.2], [0, 1 << 20], [5, 7], [False, True]):
        label = f"T={world} rank {rank} views={views}/{global_views} alpha={smoothing} cache={cache} chunk={chunk} " \
                f"sampled={sampled}"
        scored_by_rank = [_scored_rows(r, world, sampled) for r in range(world)]
        union = torch.cat(scored_by_rank)  # the reference runs over these rows, in this order
        image_ids = torch.randperm(union.numel(), generator=generator)[:images]
        ids = image_ids[image_of]
        hard = random_hard_negatives(ids, union.numel(), TOP_K, generator) if smoothing else None
        targets = ids[:, None] if hard is None else torch.cat([ids[:, None], hard], dim=1)
        target_weights = torch.tensor([[1.0]] if hard is None else [[1 - smoothing] + [smoothing / TOP_K] * TOP_K])

        # Reference: sum_c grad_loss_c L_c + grad_term_c term_c, in float64 over the full rows.
        x_ref = features.double().requires_grad_()
        w_ref = weight[union].double().requires_grad_()
        column_features = x_ref[view_of, image_of]
        per_column = torch.stack([
            reference_loss(column_features[c : c + 1], w_ref, ids[c : c + 1], None if hard is None else hard[c : c + 1],
                           smoothing, TAU, "paper")
            for c in range(batch)
        ])
        per_view = reference_co2_per_view(x_ref[:global_views], w_ref, image_ids, TAU_CON)
        term_ref = torch.where(view_of < global_views, per_view[view_of.clamp(max=global_views - 1), image_of], 0.0)
        ((per_column * grad_loss).sum() + (term_ref * grad_term).sum()).backward()

        mine = scored_by_rank[rank]
        offset = sum(rows.numel() for rows in scored_by_rank[:rank])
        local_cols = torch.where((targets >= offset) & (targets < offset + mine.numel()), targets - offset, -1)
        rows = mine if sampled else slice(int(mine[0]), int(mine[-1]) + 1)
        x = features[view_of, image_of].clone().requires_grad_()
        w = torch.nn.Parameter(weight.clone())
        settings = KernelSettings(temperature=TAU, chunk_size=chunk, logits_cache_bytes=cache)
        with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
            loss, term = sharded_cosine_ce_with_term(
                F.normalize(x, dim=1), w, local_cols, target_weights.expand(batch, -1), settings, term_in_kernel, group,
                rows=rows,
            )
            ((loss * grad_loss.float()).sum() + (term * grad_term.float()).sum()).backward()
        assert all_reduce.call_count == (2 if world > 1 else 0), f"{label}: one MAX + one SUM, as without the term"

        torch.testing.assert_close(loss.double(), per_column.detach(), atol=1e-5, rtol=1e-6, msg=label)
        torch.testing.assert_close(term.double(), term_ref.detach(), atol=2e-5, rtol=1e-5, msg=label)
        grad_x = x.grad.clone()
        if group is not None:
            dist.all_reduce(grad_x, group=group)  # each rank holds its rows' part of dL/dx
        torch.testing.assert_close(grad_x.double(), x_ref.grad[view_of, image_of], atol=5e-5, rtol=1e-5, msg=label)
        ref_grad_w = torch.zeros(NUM_ROWS, DIM, dtype=torch.float64).index_add_(0, union, w_ref.grad)
        torch.testing.assert_close(w.grad.double()[mine], ref_grad_w[mine], atol=5e-5, rtol=1e-5, msg=label)
        untouched = torch.ones(NUM_ROWS, dtype=torch.bool).index_fill_(0, mine, False)
        assert not w.grad[untouched].any(), label


# Two ranks in `make test`; one and three (a third of the suite's CO2 time) in the slow run.
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)])
def test_fused_term_matches_the_full_distributions(ranks):
    spawn_local_workers(_check_kernel, ranks, 3, 2)  # two global views and a small crop, which takes no part


# two global views (the default) are checked exactly by test_fused_term_matches_the_full_distributions
@pytest.mark.slow
def test_three_global_views_average_over_their_pairs():
    spawn_local_workers(_check_kernel, 2, 3, 3)


# -- the classifier's total loss: L_ins + alpha * L_con, padding excluded ---------------------------

ALPHA = 0.3


def _eager_co2():
    """The classifier builds its CO2 term with the chunk math run eagerly (see the module docstring)."""
    return mock.patch.object(ConsistencyTerm, "for_views", functools.partial(ConsistencyTerm.for_views, compiled=False))


def _check_classifier_total_loss():
    with _eager_co2():
        _classifier_total_loss()


def _classifier_total_loss():
    dims = init_distributed()
    rank, world = dims.rank, dims.world_size
    generator = torch.Generator().manual_seed(3)
    images = LOCAL * world
    features = torch.randn(3, images, DIM, generator=generator)  # views: global, global, small
    image_ids = torch.randperm(NUM_ROWS, generator=generator)[:images]
    valid = torch.ones(images, dtype=torch.bool)
    valid[-1] = False  # the last image is a padding repeat: it counts in neither term
    config = ClassifierConfig(
        num_classes=NUM_ROWS,
        feature_dim=DIM,
        temperature=TAU,
        chunk_size=5,
        init_std=1.0,
        co2_alpha=ALPHA,
        co2_temperature=TAU_CON,
    )
    classifier = ShardedCosineClassifier(config, dims, ViewLayout(("global", "global", "small"), (32, 32, 16)))
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    local = features[:, mine].clone().requires_grad_()
    loss = classifier(
        local.reshape(-1, DIM),
        image_ids[mine].repeat(3),
        valid=valid[mine].repeat(3),
        global_valid=int(valid.sum()) * 3,
    )
    loss.backward()

    weight = gaussian_rows(0, NUM_ROWS, DIM, 1.0, config.init_seed).double().requires_grad_()
    x_ref = features.double().requires_grad_()
    kept = valid.nonzero().squeeze(1)
    instance = reference_loss(
        x_ref[:, kept].reshape(-1, DIM), weight, image_ids[kept].repeat(3), None, 0.0, TAU, "paper"
    )
    co2 = reference_co2_pairs(x_ref[:2, kept], weight, image_ids[kept], TAU_CON).mean()
    reference = instance + ALPHA * co2
    reference.backward()

    label = f"T={world} rank {rank}"
    torch.testing.assert_close(loss.double(), reference.detach(), atol=1e-5, rtol=1e-6, msg=label)
    # Backbone gradients are averaged over ranks: each rank's feature gradient is T times its share.
    torch.testing.assert_close(local.grad.double() / world, x_ref.grad[:, mine], atol=2e-5, rtol=1e-5, msg=label)
    shard = classifier.shard
    rows = slice(shard.class_start, shard.class_end)
    torch.testing.assert_close(classifier.weight.grad.double(), weight.grad[rows], atol=2e-5, rtol=1e-5, msg=label)


def test_classifier_loss_adds_alpha_times_the_mean_term_over_valid_images():
    spawn_local_workers(_check_classifier_total_loss, 2)


# -- pic: the term over the sampled rows -------------------------------------------------------------

PIC_TAU, QUEUE, BATCH = 0.2, 7, 6


def _pic_step(objective, dims, step, ids, features):
    local = ids.size // dims.world_size
    mine = slice(dims.rank * local, (dims.rank + 1) * local)
    views = [View(features[v, mine].clone().requires_grad_(), "global", v) for v in range(2)]
    indices = StepIndices(ids=ids.reshape(dims.world_size, -1), valid=np.ones((dims.world_size, local), dtype=bool))
    step_views = StepViews(
        views, torch.from_numpy(ids[mine]), torch.ones(local, dtype=torch.bool), ids.size, 0, step, plan=indices
    )
    (optimizer,) = objective.optimizers()
    loss = objective.loss(step_views).loss
    loss.backward()
    objective.after_backward()
    leaf_grad = optimizer.pending_leaf.grad.clone()
    optimizer.step()  # lr 0: rows stay at their initial values
    optimizer.zero_grad()
    return loss, views, leaf_grad


def _check_pic_step():
    dims = init_distributed()
    config = PicConfig(
        temperature=PIC_TAU,
        chunk_size=3,
        queue_size=QUEUE,
        init_std=1.0,
        row_dtype="float64",
        prefetch=False,
        co2_alpha=ALPHA,
        co2_temperature=TAU_CON,
    )
    context = ObjectiveContext(
        dims=dims,
        num_instances=NUM_ROWS,
        feature_dim=DIM,
        seed=2,
        optim=OptimSettings(momentum=0.9, weight_decay=0.0),
        views=ViewLayout(("global", "global"), (32, 32)),
    )
    objective = build_objective(config, context)
    set_lr(objective.optimizers()[0], 0.0)
    generator = np.random.default_rng(5)
    batches = [generator.choice(NUM_ROWS, BATCH, replace=False) for _ in range(3)]
    features = [torch.from_numpy(generator.normal(size=(2, BATCH, DIM))).float() for _ in range(3)]
    for step in range(2):
        _pic_step(objective, dims, step, batches[step], features[step])
    loss, views, leaf_grad = _pic_step(objective, dims, 2, batches[2], features[2])

    sampled = np.union1d(np.concatenate(batches[:2])[-QUEUE:], batches[2])
    positions = torch.from_numpy(np.searchsorted(sampled, batches[2]))
    weight = gaussian_rows(0, NUM_ROWS, DIM, 1.0, 2).double()
    rows = weight[torch.from_numpy(sampled)].requires_grad_()
    x_ref = features[2].double().requires_grad_()
    instance = reference_loss(x_ref.reshape(-1, DIM), rows, positions.repeat(2), None, 0.0, PIC_TAU, "paper")
    reference = instance + ALPHA * reference_co2_pairs(x_ref, rows, positions, TAU_CON).mean()
    reference.backward()

    label, size = f"pic T={dims.world_size} rank {dims.rank}", dims.world_size
    torch.testing.assert_close(loss.double(), reference.detach(), atol=1e-5, rtol=1e-6, msg=label)
    local = BATCH // size
    for view in views:
        torch.testing.assert_close(
            view.features.grad.double() / size,
            x_ref.grad[view.index, dims.rank * local : (dims.rank + 1) * local],
            atol=2e-5,
            rtol=1e-5,
            msg=label,
        )
    shard = objective.shard
    owned = (sampled >= shard.class_start) & (sampled < shard.class_end)
    torch.testing.assert_close(leaf_grad.double(), rows.grad[torch.from_numpy(owned)], atol=2e-5, rtol=1e-5, msg=label)


@pytest.mark.slow  # default suite: the term on 2 ranks above; PIC with CO2 in the dry run
def test_pic_term_runs_over_the_sampled_rows():
    spawn_local_workers(_check_pic_step, 2)
