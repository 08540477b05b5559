"""The ``moco`` objective on one process: its loss is the float64 InfoNCE (and CO2) of the student's
query against the teacher's key and the queue, padding columns count for nothing, the step's keys
enter the queue after a step that was taken (and only then), the queue reloads from its state, and
the config asks the trainer for MoCo v2's views, teacher, recipe and memory plan."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from data_pipeline.contract import AugmentConfig, StepIndices, ViewLayout
from tests.helpers.moco_reference import reference_infonce
from trainer.objectives import (
    MocoConfig,
    ObjectiveContext,
    OptimSettings,
    QueuedKeys,
    ShardedRows,
    StepViews,
    View,
    build_objective,
)
from trainer.parallel import single_process_dims

DIM, BATCH, QUEUE = 8, 4, 12  # a queue of three global batches
VIEWS = ViewLayout.of_training(AugmentConfig())


def _objective(**settings):
    config = MocoConfig(queue_size=QUEUE, chunk_size=5, **settings)
    context = ObjectiveContext(dims=single_process_dims(), num_instances=50, feature_dim=DIM, seed=3,
                               optim=OptimSettings(momentum=0.9, weight_decay=0.0), views=VIEWS, global_batch=BATCH)
    return build_objective(config, context)


def _step(seed: int, valid=(True,) * BATCH):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(BATCH, DIM, generator=generator).requires_grad_()
    key = torch.randn(BATCH, DIM, generator=generator)
    ids = torch.randperm(50, generator=generator)[:BATCH]
    valid = torch.tensor(valid)
    plan = StepIndices(ids=ids.numpy()[None], valid=valid.numpy()[None])
    return StepViews(views=[View(query, "global", 0)], instance_ids=ids, valid=valid, global_valid=int(valid.sum()),
                     epoch=0, step=seed, plan=plan, teacher=[View(key, "global", 1)]), query, key, ids


@pytest.mark.parametrize("co2_alpha", [0.0, 0.3])
def test_the_loss_is_infonce_of_the_students_query_against_the_teachers_key_and_the_queue(co2_alpha):
    objective = _objective(co2_alpha=co2_alpha)
    step, query, key, _ = _step(1)
    queue = objective.queue.keys.clone()
    out = objective.loss(step)
    out.loss.backward()
    q, k = F.normalize(query.detach(), dim=1), F.normalize(key, dim=1)
    infonce, term, grad_q, _ = reference_infonce(q, k, queue, 0.2, 0.05 if co2_alpha else None, co2_alpha)
    expected = infonce + (co2_alpha * term if co2_alpha else 0)
    torch.testing.assert_close(out.loss.double(), expected, atol=1e-6, rtol=1e-6)
    # Through the normalisation: the reference's gradient is with respect to the unit query.
    unit = query.detach().double().requires_grad_()
    (F.normalize(unit, dim=1) * grad_q).sum().backward()
    torch.testing.assert_close(query.grad.double(), unit.grad, atol=1e-6, rtol=1e-5)


def test_a_padding_column_adds_nothing_and_the_mean_is_over_the_valid_samples():
    objective = _objective()
    step, query, key, _ = _step(2, valid=(True, True, True, False))
    out = objective.loss(step)
    q, k = F.normalize(query.detach(), dim=1), F.normalize(key, dim=1)
    infonce, _, _, _ = reference_infonce(q[:3], k[:3], objective.queue.keys, 0.2)
    torch.testing.assert_close(out.loss.double(), infonce, atol=1e-6, rtol=1e-6)


def test_a_taken_step_enqueues_its_keys_with_their_ids_and_a_dropped_one_nothing():
    objective = _objective()
    initial = objective.queue.keys.clone()
    step, _, key, ids = _step(3)
    objective.loss(step)
    objective.after_optimizer_step(False)  # DeepSpeed dropped the step
    assert torch.equal(objective.queue.keys, initial) and objective.queue.pointer == 0
    objective.loss(step)
    objective.skip_step()  # a non-finite loss, skipped before the backward
    assert torch.equal(objective.queue.keys, initial) and objective.queue.pointer == 0
    objective.loss(step)
    objective.after_optimizer_step(True)
    assert objective.queue.pointer == BATCH
    assert torch.equal(objective.queue.ids[:BATCH], ids) and (objective.queue.ids[BATCH:] == -1).all()
    torch.testing.assert_close(objective.queue.keys[:BATCH], F.normalize(key, dim=1))
    assert torch.equal(objective.queue.keys[BATCH:], initial[BATCH:])

    again = _objective()
    again.load_state_dict({"queue": _reloaded(objective.queue.state_dict())})
    assert torch.equal(again.queue.keys, objective.queue.keys) and torch.equal(again.queue.ids, objective.queue.ids)
    assert again.queue.pointer == BATCH


def _reloaded(state: dict) -> dict:
    """What the checkpoint's loader hands back on one rank: each ``ShardedRows`` with its rows copied."""
    return {name: replace(value, rows=value.rows.clone()) if isinstance(value, ShardedRows) else value
            for name, value in state.items()}


def test_the_config_asks_for_moco_v2s_views_teacher_recipe_and_plan():
    config = MocoConfig()
    assert (config.temperature, config.queue_size, config.momentum, config.co2_temperature) == (0.2, 65536, 0.999,
                                                                                               0.05)
    assert config.default_recipe() == "moco_v2"
    assert config.student_views(VIEWS) == (0,)
    request = config.teacher_request(VIEWS)
    assert (request.views, request.momentum, request.schedule, request.sync_batch_norm) == ((1,), 0.999, "constant",
                                                                                           True)
    assert config.memory_plan(VIEWS) == QueuedKeys(queue_size=65536, chunk_size=65536, kernel="auto", co2=False)
    assert MocoConfig(co2_alpha=0.3).memory_plan(VIEWS).co2
    with pytest.raises(ValueError, match=r"encodes views \[1\].*makes 1 views"):
        config.teacher_request(ViewLayout.single(32))


def test_bad_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="queue_size"):
        MocoConfig(queue_size=0)
    with pytest.raises(ValueError, match="momentum"):
        MocoConfig(momentum=1.5)
    with pytest.raises(ValueError, match=r"objective.queue_size=10 is invalid.*multiple of it \(e.g. 8\)"):
        _objective_with_queue(10)


def _objective_with_queue(size: int):
    context = ObjectiveContext(dims=single_process_dims(), num_instances=50, feature_dim=DIM, seed=0,
                               optim=OptimSettings(momentum=0.9, weight_decay=0.0), views=VIEWS, global_batch=BATCH)
    return build_objective(MocoConfig(queue_size=size), context)


def test_the_plan_counts_the_queues_share_and_no_gradient_for_it():
    from trainer.planning.plan_input import PlanInput
    from trainer.planning.queue_memory import queued_keys_breakdown, queued_keys_checkpoint_bytes

    queue = QueuedKeys(queue_size=65536, chunk_size=4096)
    plan = PlanInput(mode="moco", objective=queue, num_classes=0, ranks=4, batch=256, dim=128, device="cpu")
    breakdown = queued_keys_breakdown(plan, queue)
    assert breakdown["queue keys (its share x D, fp32)"] == 16384 * 128 * 4
    assert breakdown["queue sample ids"] == 16384 * 8
    assert breakdown["CO2 term (chunk scratch)"] == 0
    assert queued_keys_checkpoint_bytes(plan, queue) == 16384 * (128 * 4 + 8)
    with_co2 = queued_keys_breakdown(plan, QueuedKeys(queue_size=65536, chunk_size=4096, co2=True))
    assert with_co2["CO2 term (chunk scratch)"] == 512 * 4096 * 4  # queries and keys scored, one chunk
    workspace = "logits/activations (chunk workspace)"  # the keys' columns are scored too
    assert with_co2[workspace] - breakdown[workspace] >= 256 * 4096 * 4
