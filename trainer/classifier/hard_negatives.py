"""Top-K hardest label smoothing: the K most cosine-similar *other* rows of the sharded W.

Search (once per epoch): every rank queries with its own rows.  Each shard in turn is broadcast
to the group and searched with the local queries (faiss on the CPU, chunked matmul + topk on
CUDA), keeping a running top-K, so no rank holds more than two shards and no N x N matrix exists.

Lookup (every step): the table is sharded like W (rows of the classes a rank owns).  A step needs
the hard negatives of its local samples, whose owners are anywhere: ids are gathered over the
classifier group, each owner fills the rows it has, and one SUM all-reduce completes the table.
"""

from __future__ import annotations

import faiss
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.classifier.sharding import ClassShard
from trainer.parallel.collectives import Group, all_reduce_, gather_rows, group_rank, group_size


def _block_top_k(
    queries: torch.Tensor, keys: torch.Tensor, k: int, key_chunk: int, use_faiss: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, key rows)`` of the k largest inner products of each query within ``keys``.

    faiss on the CPU (BLAS plus a heap per query: ~9x faster than matmul + topk over a 40k x 40k
    block here); matmul + topk in key chunks on CUDA, where both are fast.
    """
    k = min(k, keys.shape[0])
    if use_faiss:
        faiss.omp_set_num_threads(torch.get_num_threads())  # ranks share the cores
        scores, rows = faiss.knn(queries.numpy(), keys.numpy(), k, metric=faiss.METRIC_INNER_PRODUCT)
        return torch.from_numpy(scores), torch.from_numpy(rows)
    best_scores = torch.full((queries.shape[0], 0), float("-inf"), device=queries.device)
    best_rows = torch.zeros((queries.shape[0], 0), dtype=torch.int64, device=queries.device)
    for start in range(0, keys.shape[0], key_chunk):
        scores, rows = (queries @ keys[start : start + key_chunk].t()).topk(min(k, keys.shape[0] - start), dim=1)
        merged_scores = torch.cat([best_scores, scores], dim=1)
        merged_rows = torch.cat([best_rows, rows + start], dim=1)
        best_scores, position = merged_scores.topk(min(k, merged_scores.shape[1]), dim=1)
        best_rows = merged_rows.gather(1, position)
    return best_scores, best_rows


@torch.no_grad()
def search_hard_negatives(
    weight_local: torch.Tensor,
    shard: ClassShard,
    group: Group,
    top_k: int,
    query_chunk: int = 8192,
    key_chunk: int = 65536,
    use_faiss: bool | None = None,
) -> torch.Tensor:
    """``[N_local, K]`` int64 global ids of the K most similar other rows of each local row.

    ``use_faiss`` defaults to True for CPU tensors and False for CUDA ones.
    """
    if top_k > shard.num_classes - 1:
        raise ValueError(f"smoothing_top_k={top_k} needs at least {top_k + 1} instances, have {shard.num_classes}")
    queries = F.normalize(weight_local.float(), dim=1).contiguous()
    device = queries.device
    if use_faiss is None:
        use_faiss = device.type == "cpu"
    best_scores = torch.full((queries.shape[0], top_k), float("-inf"), device=device)
    best_ids = torch.full((queries.shape[0], top_k), -1, dtype=torch.int64, device=device)
    query_ids = torch.arange(shard.class_start, shard.class_end, device=device)
    for source in range(group_size(group)):
        source_shard = ClassShard(shard.num_classes, shard.num_shards, source)
        if source == group_rank(group):
            keys = queries
        else:
            keys = torch.empty(source_shard.num_classes_local, queries.shape[1], device=device)
        if group is not None:
            dist.broadcast(keys, group_src=source, group=group)
        for q_start in range(0, queries.shape[0], query_chunk):
            q_end = min(q_start + query_chunk, queries.shape[0])
            # One extra candidate: a query's own row is in its own shard and must be dropped.
            scores, rows = _block_top_k(queries[q_start:q_end], keys, top_k + 1, key_chunk, use_faiss)
            candidate_ids = rows.to(device) + source_shard.class_start
            scores = scores.to(device).masked_fill(candidate_ids == query_ids[q_start:q_end, None], float("-inf"))
            merged_scores = torch.cat([best_scores[q_start:q_end], scores], dim=1)
            merged_ids = torch.cat([best_ids[q_start:q_end], candidate_ids], dim=1)
            top_scores, position = merged_scores.topk(top_k, dim=1)
            best_scores[q_start:q_end] = top_scores
            best_ids[q_start:q_end] = merged_ids.gather(1, position)
    return best_ids


class HardNegativeTable:
    """The search result, sharded like W, with the per-step lookup for a local batch."""

    def __init__(self, local_table: torch.Tensor, shard: ClassShard, group: Group) -> None:
        self.local_table = local_table
        self.shard = shard
        self.group = group

    @property
    def top_k(self) -> int:
        return self.local_table.shape[1]

    @torch.no_grad()
    def lookup(self, instance_ids: torch.Tensor) -> torch.Tensor:
        """``[b, K]`` hard negatives of this rank's samples (one gather + one all-reduce)."""
        all_ids = gather_rows(instance_ids, self.group)
        owned = self.shard.is_local(all_ids)
        rows = (all_ids - self.shard.class_start).clamp(0, self.shard.num_classes_local - 1)
        table = torch.where(owned[:, None], self.local_table[rows], 0)
        all_reduce_(table, dist.ReduceOp.SUM, self.group)  # exactly one owner contributes each row
        local = instance_ids.shape[0]
        start = group_rank(self.group) * local
        return table[start : start + local]
