"""The instance objective's checkpoint state is world-size independent: steps run on T' ranks after
loading a T-rank checkpoint equal the same steps run on the T ranks (W, momentum, hard negatives),
with label smoothing on and SGD momentum and weight decay."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.checkpoint.components import load_component, save_component
from trainer.engine.schedule import set_lr
from trainer.objectives import InstanceConfig, ObjectiveContext, OptimSettings, StepViews, View, build_objective
from trainer.parallel import init_distributed
from trainer.parallel.collectives import gather_rows
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

NUM_CLASSES, DIM, GLOBAL_BATCH, TOP_K = 37, 8, 6, 3
CONFIG = InstanceConfig(chunk_size=5, contrastive_prior=False, init_std=1.0, smoothing_alpha=0.2, top_k=TOP_K)


def _objective(dims):
    context = ObjectiveContext(dims=dims, num_instances=NUM_CLASSES, feature_dim=DIM, seed=3,
                               optim=OptimSettings(momentum=0.9, weight_decay=1e-2))
    objective = build_objective(CONFIG, context)
    objective.on_epoch_start(0)  # the hard-negative search
    return objective


def _step(objective, dims, step: int) -> None:
    """One step on the same global batch whatever the world size (each rank takes its slice)."""
    generator = torch.Generator().manual_seed(100 + step)
    features = torch.randn(2, GLOBAL_BATCH, DIM, generator=generator)
    ids = torch.randperm(NUM_CLASSES, generator=generator)[:GLOBAL_BATCH]
    local = GLOBAL_BATCH // dims.world_size
    mine = slice(dims.rank * local, (dims.rank + 1) * local)
    views = [View(features[v, mine].clone().requires_grad_(), "global", v) for v in range(2)]
    optimizer, = objective.optimizers()
    set_lr(optimizer, 0.5)
    loss = objective.loss(StepViews(views, ids[mine], torch.ones(local, dtype=torch.bool), GLOBAL_BATCH, 0, step)).loss
    loss.backward()
    objective.after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _full_state(objective, dims) -> dict[str, torch.Tensor]:
    """Rows of every rank, gathered in class order (shards padded to the largest)."""
    state = objective.state_dict()
    out = {}
    for key in ("weight", "momentum", "hard_negatives"):
        rows = state[key].rows
        largest = -(-NUM_CLASSES // dims.world_size)
        padded = torch.zeros(largest, rows.shape[1], dtype=rows.dtype)
        padded[: rows.shape[0]] = rows
        counts = gather_rows(torch.tensor([rows.shape[0]]), dims.classifier_group)
        blocks = gather_rows(padded, dims.classifier_group).view(dims.world_size, largest, -1)
        out[key] = torch.cat([blocks[r, : counts[r]] for r in range(dims.world_size)])
    return out


def _train_and_save(folder: str) -> None:
    dims = init_distributed()
    objective = _objective(dims)
    for step in range(2):
        _step(objective, dims, step)
    if dims.rank == 0:
        Path(folder, "components", "objective").mkdir(parents=True)
    dist.barrier()
    save_component(folder, "objective", objective, dims)
    dist.barrier()
    for step in range(2, 4):
        _step(objective, dims, step)
    full = _full_state(objective, dims)
    if dims.rank == 0:
        torch.save(full, f"{folder}/reference.pt")


def _load_and_continue(folder: str) -> None:
    dims = init_distributed()
    objective = build_objective(CONFIG, ObjectiveContext(dims=dims, num_instances=NUM_CLASSES, feature_dim=DIM, seed=99,
                                                         optim=OptimSettings(momentum=0.9, weight_decay=1e-2)))
    load_component(folder, "objective", objective, dims, dims.device)  # a different seed: all rows come from the file
    objective.on_epoch_start(0)  # the loaded table is for epoch 0: no new search
    for step in range(2, 4):
        _step(objective, dims, step)
    full = _full_state(objective, dims)
    reference = torch.load(f"{folder}/reference.pt", weights_only=True)
    for key in reference:
        torch.testing.assert_close(
            full[key], reference[key], atol=1e-6, rtol=0, msg=f"{key} on {dims.world_size} ranks"
        )


@pytest.mark.parametrize("new_world_size", [pytest.param(1, marks=pytest.mark.slow), 3])  # 2 -> 3: uneven shards
def test_steps_after_a_reshard_equal_the_same_steps_unresharded(tmp_path, new_world_size):
    spawn_local_workers(_train_and_save, 2, str(tmp_path))
    spawn_local_workers(_load_and_continue, new_world_size, str(tmp_path))
