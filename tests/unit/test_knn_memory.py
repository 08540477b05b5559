"""The sharded kNN's device memory per rank: executed on fake CUDA devices as one rank of 64 (the
``fake`` process group) with a million held-out queries, its peak stays under the planner's figure
(``knn_memory``), which does not grow with the queries times the ranks, and far under what scoring
every query on every rank needs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer.dry_run.collectives import CollectiveRecorder
from trainer.dry_run.host_syncs import HostSyncRecorder
from trainer.evaluation.knn_memory import knn_memory_breakdown, knn_peak_bytes
from trainer.evaluation.sharded_knn import KnnBankShard, sharded_neighbours, weighted_vote

RANKS, QUERIES, BANK_ROWS, K = 64, 1_000_000, 1_281_167, 20  # ImageNet-1K's training set as the bank
QUERY_CHUNK = 1024
GIB = 1 << 30


def _gathered_every_query_bytes(queries: int, dim: int) -> int:
    """Scoring every query on every rank: the queries all-gathered (padded, concatenated, normalised)
    and every rank's [queries, k] candidates (similarity, id, label) all-gathered and reordered."""
    return 3 * queries * dim * 4 + 2 * RANKS * queries * K * (4 + 8 + 8)


def _fake_rank_knn(dim: int, rank: int, rounds: int | None) -> tuple[int, list]:
    """(peak bytes, collectives) of one rank's ``sharded_neighbours`` and vote on fake CUDA tensors,
    for its first ``rounds`` rounds (None: all of them; each round has the same shapes)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=RANKS)
    own_queries, own_bank = -(-QUERIES // RANKS), -(-BANK_ROWS // RANKS)
    block = QUERY_CHUNK // RANKS
    device = torch.device("cuda", rank % 8)
    # Fake tensors hold no values: a value read answers 1 and a mask keeps every element, so the tie
    # path of block_top_k_columns re-sorts every row (its worst case, which the plan counts)
    recorder, collectives = HostSyncRecorder(assume_values=True), CollectiveRecorder()
    try:
        with FakeTensorMode(), MemTracker() as memory, collectives, recorder:
            shard = KnnBankShard(torch.empty(own_bank, dim, dtype=torch.float16, device=device),
                                 torch.empty(own_bank, dtype=torch.int64, device=device),
                                 torch.empty(own_bank, dtype=torch.int64, device=device), BANK_ROWS)
            queries = torch.empty(own_queries, dim, device=device)
            labels = torch.empty(own_queries, dtype=torch.int64, device=device)
            neighbours = sharded_neighbours(shard, queries, K, dist.group.WORLD, query_chunk=QUERY_CHUNK,
                                            most_queries=own_queries if rounds is None else rounds * block)
            assert neighbours.ids.shape == (own_queries, K)
            (weighted_vote(neighbours, 0.07) == labels).sum()
        peak = memory.get_tracker_snapshot("peak")[device]["Total"]
    finally:
        dist.destroy_process_group()
    return peak, collectives.collectives


@pytest.mark.parametrize("dim, rounds", [
    (128, 3), (2048, 3),  # every round has one round's shapes: the peak is reached in the first
    pytest.param(128, None, marks=pytest.mark.slow),  # all 977 rounds (about 100 s)
])
@pytest.mark.integration
def test_one_rank_of_64_scores_a_million_queries_under_the_planned_peak(dim, rounds):
    peak, collectives = _fake_rank_knn(dim, rank=9, rounds=rounds)
    planned = knn_peak_bytes(QUERIES, BANK_ROWS, dim, K, RANKS, QUERY_CHUNK)
    print(f"kNN, rank 9 of {RANKS}, {QUERIES:,} queries, D={dim}: executed {peak / 2**20:.1f} MiB, "
          f"planned {planned / 2**20:.1f} MiB")
    assert peak <= planned <= 1.3 * peak, f"measured {peak / GIB:.3f} GiB, planned {planned / GIB:.3f} GiB"
    assert planned < GIB and 50 * peak < _gathered_every_query_bytes(QUERIES, dim)
    # per round: the query blocks all-gathered, the candidates sent to their owners; each moves one
    # round's rows, whatever the number of queries
    ops = [c.op for c in collectives]
    assert set(ops) == {"_allgather_base_", "alltoall_base_"} and ops.count("alltoall_base_") == len(ops) // 2
    assert all(c.tensors == (f"float32[{QUERY_CHUNK}, {dim}]", f"float32[{QUERY_CHUNK // RANKS}, {dim}]")
               for c in collectives if c.op == "_allgather_base_")
    assert all(c.tensors == (f"int64[{QUERY_CHUNK}, {3 * K}]",) * 2 for c in collectives if c.op == "alltoall_base_")


def test_the_plan_per_rank_does_not_grow_with_queries_times_ranks():
    at_64 = knn_memory_breakdown(QUERIES, BANK_ROWS, 128, K, 64)
    at_128 = knn_memory_breakdown(QUERIES, BANK_ROWS, 128, K, 128)
    assert all(at_128[part] <= at_64[part] for part in at_64), "more ranks: no part grows"
    ten_times = knn_memory_breakdown(10 * QUERIES, BANK_ROWS, 128, K, 64)
    grown = {part for part in at_64 if ten_times[part] != at_64[part]}
    assert grown == {"own queries (float32) and labels", "own queries' neighbours and predictions"}
    assert knn_peak_bytes(QUERIES, BANK_ROWS, 2048, K, 64, bank_element_bytes=4) > \
        knn_peak_bytes(QUERIES, BANK_ROWS, 2048, K, 64)  # a float32 bank costs more than float16
