"""MoCo's queue loss and key queue across gloo ranks: each rank scores its slots of the queue (a split
that is not even) and the loss, CO2's term and the gradients of every rank's queries (and keys) match
the float64 single-process reference with the full ``[B, 1 + K]`` logits; the loss costs the kernel's
two all-reduces, CO2 included; and keys all-gathered into the queue land in the slots a single
process would put them in."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers.moco_reference import reference_infonce, replayed_slot_ids
from trainer.classifier.kernel.chunked import KernelSettings
from trainer.classifier.sharding import ClassShard
from trainer.objectives.moco.key_queue import KeyQueue
from trainer.objectives.moco.queue_loss import queue_infonce
from trainer.parallel import init_distributed
from trainer.parallel.collectives import gather_rows
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

QUEUE, DIM, LOCAL_BATCH, CHUNK = 23, 8, 3, 5  # 23 slots: 12/11 on 2 ranks, 8/8/7 on 3
TAU, TAU_CON, ALPHA = 0.2, 0.05, 0.3
QUEUE_STEPS, QUEUE_SLOTS_PER_BATCH = 7, 3  # the queue holds 3 global batches: 7 steps wrap it twice


def _check_loss_against_reference(rank: int, ranks: int, group) -> None:
    generator = torch.Generator().manual_seed(5)
    batch = LOCAL_BATCH * ranks
    query = F.normalize(torch.randn(batch, DIM, generator=generator), dim=1)
    key = F.normalize(query + 0.5 * torch.randn(batch, DIM, generator=generator), dim=1)
    queue = F.normalize(torch.randn(QUEUE, DIM, generator=generator), dim=1)
    shard = ClassShard(QUEUE, ranks, rank)
    local_queue = queue[shard.class_start: shard.class_end]
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    settings = KernelSettings(temperature=TAU, chunk_size=CHUNK)
    for consistency, key_has_grad in [(None, False), (None, True), (TAU_CON, False), (TAU_CON, True)]:
        label = f"rank {rank} of {ranks}, tau_con={consistency}, key with grad={key_has_grad}"
        q = query[mine].clone().requires_grad_()
        k = key[mine].clone().requires_grad_(key_has_grad)
        with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
            result = queue_infonce(q, k, local_queue, settings, group, consistency, compiled=False)
            total = result.loss.mean()
            if consistency is not None:
                total = total + ALPHA * result.consistency.mean()
            total.backward()
        assert all_reduce.call_count == 2, f"{label}: one MAX + one SUM, nothing in backward"

        ref_loss, ref_term, ref_grad_q, ref_grad_k = reference_infonce(query, key, queue, TAU, consistency, ALPHA)
        torch.testing.assert_close(result.loss.mean().double(), ref_loss, atol=1e-6, rtol=1e-6, msg=label)
        if consistency is not None:
            torch.testing.assert_close(result.consistency.mean().double(), ref_term, atol=1e-5, rtol=1e-5, msg=label)
        torch.testing.assert_close(q.grad.double(), ref_grad_q[mine], atol=1e-5, rtol=1e-4, msg=label)
        if key_has_grad:
            torch.testing.assert_close(k.grad.double(), ref_grad_k[mine], atol=1e-5, rtol=1e-4, msg=label)


def _check_gathered_keys_land_in_the_single_process_slots(rank: int, ranks: int, group) -> None:
    global_batch = LOCAL_BATCH * ranks
    size = QUEUE_SLOTS_PER_BATCH * global_batch
    queue = KeyQueue(size, DIM, global_batch, rank, ranks)
    steps_ids = []
    for step in range(QUEUE_STEPS):
        # The sampler's global order is rank-major: this rank's samples are its slice of the step's ids.
        ids = 100 * step + torch.randperm(100, generator=torch.Generator().manual_seed(step))[:global_batch]
        keys = F.normalize(ids[:, None].float() + torch.arange(DIM), dim=1)  # a key that names its sample
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        queue.enqueue(gather_rows(keys[mine], group), gather_rows(ids[mine], group))
        steps_ids.append(ids.tolist())
    expected = torch.tensor(replayed_slot_ids(size, steps_ids))[queue.slot_start: queue.slot_end]
    assert torch.equal(queue.ids, expected), f"rank {rank} of {ranks}"
    assert torch.equal(queue.keys, F.normalize(expected[:, None].float() + torch.arange(DIM), dim=1))


def _check_queue_on_ranks():
    dims = init_distributed()
    _check_loss_against_reference(dims.rank, dims.world_size, dims.classifier_group)
    _check_gathered_keys_land_in_the_single_process_slots(dims.rank, dims.world_size, dims.data_parallel_group)


def test_queue_loss_and_slots_on_two_ranks():
    spawn_local_workers(_check_queue_on_ranks, 2)


@pytest.mark.slow
def test_queue_loss_and_slots_on_three_ranks():
    spawn_local_workers(_check_queue_on_ranks, 3)
