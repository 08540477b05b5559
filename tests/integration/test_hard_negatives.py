"""Hard-negative search and lookup against a brute-force N x N reference, on 1-3 ranks."""

import pytest
import torch
import torch.nn.functional as F

from trainer.classifier import ClassShard, gaussian_rows
from trainer.classifier.hard_negatives import HardNegativeIndex, search_hard_negatives
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

NUM_CLASSES, DIM, TOP_K = 53, 6, 7


def brute_force_top_k(weight, top_k):
    w = F.normalize(weight.double(), dim=1)
    similarity = w @ w.t()
    similarity.fill_diagonal_(float("-inf"))
    top = similarity.topk(top_k + 1, dim=1)
    # Exact comparison needs no near-ties: fp32 (and faiss's AVX2 or AVX-512 build) errs by ~1e-7.
    assert (top.values[:, :-1] - top.values[:, 1:]).min() > 1e-5, "pick rows without near-ties"
    return top.indices[:, :top_k]


def _check(chunks, use_faiss=None):
    dims = init_distributed()
    group_size = dims.classifier_parallel_size
    full = gaussian_rows(0, NUM_CLASSES, DIM, std=1.0, seed=4)
    shard = ClassShard(NUM_CLASSES, group_size, dims.classifier_rank)
    local = full[shard.class_start : shard.class_end]
    expected = brute_force_top_k(full, TOP_K)
    query_chunk, key_chunk = chunks
    found = search_hard_negatives(local, shard, dims.classifier_group, TOP_K, query_chunk, key_chunk, use_faiss)
    assert torch.equal(found, expected[shard.class_start : shard.class_end]), f"rank {dims.rank}"

    # The step's lookup: for any gathered ids, the local row of each hard negative this rank owns.
    index = HardNegativeIndex(found, shard, dims.classifier_group)
    generator = torch.Generator().manual_seed(0)  # the same gathered ids on every rank
    ids = torch.cat([torch.randint(0, NUM_CLASSES, (9,), generator=generator), torch.tensor([0, 0, NUM_CLASSES - 1])])
    negatives = expected[ids]
    local = torch.where(shard.is_local(negatives), negatives - shard.class_start, -1)
    assert torch.equal(index.local_columns(ids), local), f"lookup on rank {dims.rank}"


@pytest.mark.parametrize("use_faiss", [True, False], ids=["faiss", "matmul-topk"])
def test_single_rank_search_matches_brute_force(monkeypatch, use_faiss):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _check((5, 11), use_faiss)


@pytest.mark.parametrize("world_size,chunks,use_faiss", [pytest.param(2, (4, 9), True, marks=pytest.mark.slow),
                                                      pytest.param(2, (4, 9), False, marks=pytest.mark.slow),
                                                      (3, (100, 100), None)])
def test_sharded_search_matches_brute_force(world_size, chunks, use_faiss):
    spawn_local_workers(_check, world_size, chunks, use_faiss)


def test_top_k_needs_enough_instances():
    with pytest.raises(ValueError, match="needs at least 8 instances"):
        search_hard_negatives(torch.randn(5, 3), ClassShard(5, 1, 0), None, top_k=7)
