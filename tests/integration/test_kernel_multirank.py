"""The kernel across 2 gloo ranks, each scoring its shard (or a sample of it), against the float64
reference on the union of scored rows; and the two-collective budget of the reductions."""

import itertools
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers.reference import random_hard_negatives, reference_grads
from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce
from trainer.classifier.kernel.reductions import SampleColumns, reduce_over_ranks
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

NUM_ROWS, DIM, BATCH, TOP_K, TAU = 37, 8, 12, 4, 0.15


def _scored_rows(rank, world, sampled):
    """Global rows this rank scores: its contiguous shard, or every other row of it."""
    shard = torch.arange(NUM_ROWS).tensor_split(world)[rank]
    return shard[::2] if sampled else shard


def _check_kernel_against_reference():
    dims = init_distributed()
    rank, world, group = dims.rank, dims.world_size, dims.classifier_group
    generator = torch.Generator().manual_seed(4)
    features = torch.randn(BATCH, DIM, generator=generator)
    weight = torch.randn(NUM_ROWS, DIM, generator=generator)
    for form, alpha, cache, sampled in itertools.product(["paper", "soft_target"], [0.0, 0.2], [0, 1 << 20],
                                                         [False, True]):
        scored_by_rank = [_scored_rows(r, world, sampled) for r in range(world)]
        union = torch.cat(scored_by_rank)  # the reference softmax runs over these rows, in this order
        ids = torch.randint(0, union.numel(), (BATCH,), generator=generator)
        hard = random_hard_negatives(ids, union.numel(), TOP_K, generator) if alpha else None
        targets = ids[:, None] if hard is None else torch.cat([ids[:, None], hard], dim=1)
        weights = torch.tensor([[1.0]] if hard is None else [[1 - alpha] + [alpha / TOP_K] * TOP_K])

        mine = scored_by_rank[rank]
        offset = sum(rows.numel() for rows in scored_by_rank[:rank])
        local_cols = torch.where((targets >= offset) & (targets < offset + mine.numel()), targets - offset, -1)
        rows = mine if sampled else slice(int(mine[0]), int(mine[-1]) + 1)
        x = features.clone().requires_grad_()
        w = torch.nn.Parameter(weight.clone())
        settings = KernelSettings(temperature=TAU, chunk_size=5, form=form, logits_cache_bytes=cache)
        with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
            per_sample = sharded_cosine_ce(F.normalize(x, dim=1), w, local_cols, weights.expand(BATCH, -1),
                                           settings, group, rows=rows)
            forward_collectives = all_reduce.call_count
            per_sample.mean().backward()
        assert forward_collectives == 2 and all_reduce.call_count == 2, "one MAX + one SUM, nothing in backward"

        label = f"rank {rank} {form} alpha={alpha} cache={cache} sampled={sampled}"
        ref_loss, ref_grad_x, ref_grad_union = reference_grads(features, weight[union], ids, hard, alpha, TAU, form)
        ref_grad_w = torch.zeros(NUM_ROWS, DIM, dtype=torch.float64).index_add_(0, union, ref_grad_union)
        local_grad_x = x.grad.clone()
        dist.all_reduce(local_grad_x, group=group)  # each rank holds its shard's part of dL/dx
        torch.testing.assert_close(per_sample.mean().double(), ref_loss, atol=1e-6, rtol=1e-6, msg=label)
        torch.testing.assert_close(local_grad_x.double(), ref_grad_x, atol=1e-6, rtol=0, msg=label)
        torch.testing.assert_close(w.grad.double()[mine], ref_grad_w[mine], atol=1e-6, rtol=0, msg=label)
        untouched = torch.ones(NUM_ROWS, dtype=torch.bool).index_fill_(0, mine, False)
        assert not w.grad[untouched].any(), label


def test_kernel_matches_reference_on_two_ranks():
    spawn_local_workers(_check_kernel_against_reference, 2)


def _extra_columns_share_the_two_collectives():
    dims = init_distributed()
    rank = dims.rank
    local = torch.tensor([[0.0, 1.0], [2.0, float("-inf")]])[:, rank]  # rank 1 has nothing for sample 1
    columns = SampleColumns(logsumexp={"a": local + rank, "b": local * 2}, sums={"c": torch.full((2,), rank + 1.0)})
    columns = columns.add(SampleColumns(logsumexp={"extra": torch.zeros(2)}, sums={"extra_sum": torch.ones(2)}))
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        reduced = reduce_over_ranks(columns, dims.classifier_group)
    assert all_reduce.call_count == 2
    rank_values = torch.tensor([[0.0, 1.0], [2.0, float("-inf")]])
    expected_a = torch.logsumexp(rank_values + torch.tensor([0.0, 1.0]), dim=1)
    torch.testing.assert_close(reduced["a"], expected_a)
    torch.testing.assert_close(reduced["b"], torch.logsumexp(rank_values * 2, dim=1))
    torch.testing.assert_close(reduced["c"], torch.full((2,), 3.0))
    torch.testing.assert_close(reduced["extra"], torch.full((2,), torch.log(torch.tensor(2.0)).item()))
    torch.testing.assert_close(reduced["extra_sum"], torch.full((2,), 2.0))


def test_extra_columns_share_the_two_collectives():
    spawn_local_workers(_extra_columns_share_the_two_collectives, 2)
