"""SwAV on gloo ranks against independent single-process references.

* The distributed log-domain Sinkhorn equals SwAV's plain Sinkhorn-Knopp on the concatenated batch
  in float64 (T = 2, 3); columns sum to 1, rows to B/K; no NaN for scores up to +-1/eps.
* Loss and gradients (features, prototypes) equal a reference that loops over the crop pairs.
* Prototypes do not move while frozen and do afterwards; the queue holds the last features pushed;
  a 2 -> 1 reshard keeps its contents.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.checkpoint.components import load_component, save_component
from trainer.engine.schedule import set_lr
from trainer.objectives import ObjectiveContext, OptimSettings, StepViews, SwavConfig, View, build_objective
from trainer.objectives.swav.sinkhorn import distributed_sinkhorn
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

EPS, ITERATIONS, K, DIM, BATCH = 0.05, 3, 10, 8, 12  # BATCH: global


def reference_sinkhorn(scores: torch.Tensor, epsilon: float, iterations: int) -> torch.Tensor:
    """SwAV's algorithm as published (linear domain, float64, one process): Q is K x B."""
    q = torch.exp(scores.double() / epsilon).t()
    q /= q.sum()
    num_prototypes, batch = q.shape
    for _ in range(iterations):
        q /= q.sum(dim=1, keepdim=True)
        q /= num_prototypes
        q /= q.sum(dim=0, keepdim=True)
        q /= batch
    return (q * batch).t()


def _mine(tensor, dims):
    local = tensor.shape[0] // dims.world_size
    return tensor[dims.rank * local : (dims.rank + 1) * local]


def _check_sinkhorn():
    dims = init_distributed()
    generator = torch.Generator().manual_seed(1)
    scores = F.normalize(torch.randn(BATCH, DIM, generator=generator), dim=1) @ \
        F.normalize(torch.randn(K, DIM, generator=generator), dim=1).t()
    for dtype in (torch.float32, torch.float64):
        codes = distributed_sinkhorn(_mine(scores, dims), EPS, ITERATIONS, dims.data_parallel_group, dtype=dtype)
        torch.testing.assert_close(codes.double(), _mine(reference_sinkhorn(scores, EPS, ITERATIONS), dims),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(codes.sum(dim=1).double(), torch.ones(codes.shape[0], dtype=torch.float64),
                                   rtol=0, atol=1e-6)
    # Converged, the prototype masses are equal: rows sum to B/K.
    codes = distributed_sinkhorn(_mine(scores, dims), EPS, 200, dims.data_parallel_group, dtype=torch.float64)
    row_sums = codes.sum(dim=0)
    dist.all_reduce(row_sums)
    torch.testing.assert_close(row_sums, torch.full((K,), BATCH / K, dtype=torch.float64), rtol=1e-4, atol=0)
    # Unnormalised scores up to +-1/eps: exp(scores/eps) = exp(+-400) would be inf; no NaN here.
    wild = (torch.rand(BATCH, K, generator=generator) * 2 - 1) / EPS
    codes = distributed_sinkhorn(_mine(wild, dims), EPS, ITERATIONS, dims.data_parallel_group)
    assert torch.isfinite(codes).all()
    torch.testing.assert_close(codes.sum(dim=1), torch.ones(codes.shape[0]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_distributed_sinkhorn_equals_the_single_process_reference(ranks):
    spawn_local_workers(_check_sinkhorn, ranks)


# -- the objective ----------------------------------------------------------------------------

def _objective(dims, **overrides):
    config = SwavConfig(num_prototypes=K, epsilon=EPS, sinkhorn_iterations=ITERATIONS, **overrides)
    context = ObjectiveContext(dims=dims, num_instances=100, feature_dim=DIM, seed=4,
                               optim=OptimSettings(momentum=0.9, weight_decay=1e-4))
    return build_objective(config, context)


KINDS = ["global", "global", "small", "small", "small"]


def _step(objective, dims, step, lr=0.5):
    """One trainer step on a global batch that depends only on ``step``; returns (loss, views)."""
    generator = torch.Generator().manual_seed(50 + step)
    features = torch.randn(len(KINDS), BATCH, DIM, generator=generator)
    views = [View(_mine(features[v], dims).clone().requires_grad_(), kind, v) for v, kind in enumerate(KINDS)]
    optimizer, = objective.optimizers()
    set_lr(optimizer, lr)
    local = BATCH // dims.world_size
    loss = objective.loss(
        StepViews(views, torch.arange(local), torch.ones(local, dtype=torch.bool), BATCH, 0, step)
    ).loss
    loss.backward()
    objective.after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, views, features


def reference_loss(features: torch.Tensor, prototypes: torch.Tensor, temperature: float = 0.1):
    """Mean over samples of the swapped prediction, looping over (global crop, other view) pairs."""
    z = [F.normalize(f.double(), dim=1) for f in features]
    c = prototypes.double()
    total, pairs = 0.0, 0
    for i, kind_i in enumerate(KINDS):
        if kind_i != "global":
            continue
        q = reference_sinkhorn((z[i] @ c.t()).detach(), EPS, ITERATIONS)
        subloss = 0.0
        for v in range(len(KINDS)):
            if v != i:
                subloss = subloss - (q * torch.log_softmax(z[v] @ c.t() / temperature, dim=1)).sum(dim=1).mean()
        total = total + subloss / (len(KINDS) - 1)
        pairs += 1
    return total / pairs


def _check_loss_and_gradients():
    dims = init_distributed()
    objective = _objective(dims, freeze_prototypes_steps=0)
    prototypes = objective.prototypes.detach().clone().double().requires_grad_()
    generator = torch.Generator().manual_seed(50)
    features = torch.randn(len(KINDS), BATCH, DIM, generator=generator).double().requires_grad_()
    reference = reference_loss(features, prototypes)
    reference.backward()

    loss, views, _ = _step(objective, dims, 0, lr=0.0)  # lr 0: the step leaves the prototypes where they are
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    torch.testing.assert_close(mean_loss.double() / dims.world_size, reference.detach(), rtol=1e-6, atol=1e-6)
    for view in views:  # each rank's loss is world x its share: the engine averages the backbone's gradients
        torch.testing.assert_close(
            view.features.grad.double() / dims.world_size, _mine(features.grad[view.index], dims), rtol=0, atol=1e-6
        )
    momentum = objective.optimizer.state[objective.prototypes]["momentum_buffer"]  # = averaged grad + wd * C
    expected = prototypes.grad + 1e-4 * prototypes.detach()
    torch.testing.assert_close(momentum.double(), expected, rtol=0, atol=1e-6)


def test_loss_and_gradients_equal_the_crop_pair_reference():
    spawn_local_workers(_check_loss_and_gradients, 2)


def _check_freeze_queue_and_save(folder: str):
    dims = init_distributed()
    objective = _objective(dims, freeze_prototypes_steps=3, queue_length=8, queue_start_epoch=0)
    objective.on_epoch_start(0)
    start = objective.prototypes.detach().clone()
    for step in range(3):
        _, _, features = _step(objective, dims, step)
        assert torch.equal(objective.prototypes.detach(), start), "frozen prototypes moved"
    _, _, features = _step(objective, dims, 3)
    assert not torch.allclose(objective.prototypes.detach(), start), "prototypes did not move after the freeze"
    # The queue (4 entries per rank, newest first) holds this rank's last 4 global-crop features.
    latest = torch.stack([F.normalize(_mine(features[i], dims), dim=1) for i in (0, 1)], dim=1)
    previous = torch.stack([F.normalize(_mine(_step_features(2)[i], dims), dim=1) for i in (0, 1)], dim=1)
    torch.testing.assert_close(objective.queue, torch.cat([latest, previous])[:4])
    if dims.rank == 0:
        Path(folder, "components", "objective").mkdir(parents=True)
    dist.barrier()
    save_component(folder, "objective", objective, dims)
    gathered = [torch.zeros_like(objective.queue) for _ in range(dims.world_size)]
    dist.all_gather(gathered, objective.queue)
    if dims.rank == 0:
        torch.save(torch.cat(gathered), Path(folder, "queue.pt"))


def _step_features(step):
    return torch.randn(len(KINDS), BATCH, DIM, generator=torch.Generator().manual_seed(50 + step))


def _check_reshard(folder: str):
    dims = init_distributed()
    objective = _objective(dims, queue_length=8, queue_start_epoch=0)
    load_component(folder, "objective", objective, dims, dims.device)
    torch.testing.assert_close(objective.queue, torch.load(Path(folder, "queue.pt"), weights_only=True), rtol=0, atol=0)


def test_freeze_queue_and_a_reshard_keeping_the_queue(tmp_path):
    spawn_local_workers(_check_freeze_queue_and_save, 2, str(tmp_path))
    spawn_local_workers(_check_reshard, 1, str(tmp_path))
