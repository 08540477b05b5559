"""Top-K hardest label smoothing: the K most cosine-similar *other* rows of the sharded W.

Search (once per epoch): every rank queries with its own rows.  Each shard in turn is broadcast
to the group and searched with the local queries (faiss on the CPU, chunked matmul + topk on
CUDA), keeping a running top-K, so no rank holds more than two shards and no N x N matrix exists.

Lookup (every step): ``HardNegativeIndex`` keeps each table entry on the rank that owns the
*negative*, so the targets of the gathered batch are found locally (see its docstring).
"""

from __future__ import annotations

import faiss
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from trainer.classifier.sharding import ClassShard
from trainer.parallel.collectives import Group, group_rank, group_size


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
        raise ValueError(f"top_k={top_k} needs at least {top_k + 1} instances, have {shard.num_classes}")
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


class HardNegativeIndex:
    """The search result, stored where each *negative* lives, so a step needs no communication.

    The search leaves each rank with the K hard negatives of the instances it owns (the owner-side
    table, ``[N_local, K]`` global ids, which is what checkpoints keep).  A step, however, needs on
    each rank the hard negatives that fall in *its* class range, for every gathered sample.  So the
    table is inverted once per search (one all-to-all of O(N*K/T) entries): every rank keeps the
    (instance, slot, local column) triples whose negative it owns, sorted by instance.  The per-step
    lookup is then a local ``searchsorted`` over the gathered ids: no all-reduce, no second gather,
    and fixed shapes (an instance has at most K entries on a rank), so no host sync on a GPU.
    With a single shard (DDP, or one rank) the owner-side table already is that index.
    """

    def __init__(self, owner_table: torch.Tensor, shard: ClassShard, group: Group) -> None:
        self.owner_table = owner_table  # [N_local, K] global ids of the K hardest negatives of each local row
        self.shard = shard
        self.top_k = owner_table.shape[1]
        self._inverted = None if shard.num_shards == 1 else _invert(owner_table, shard, group)

    @torch.no_grad()
    def local_columns(self, instance_ids: torch.Tensor) -> torch.Tensor:
        """``[B, K]``: column ``k`` is the local row of the k-th hard negative of each instance when
        this rank owns it, else -1 (the same layout as the owner-side table)."""
        # The callers' ids are often a strided column of the group's [ranks, views, b] ids;
        # searchsorted wants (and warns about) contiguous values: B int64s, copied once.
        ids = instance_ids.long().contiguous()
        if self._inverted is None:
            return self.owner_table[ids - self.shard.class_start] - self.shard.class_start
        instances, slots, columns = self._inverted
        top_k, batch = self.top_k, ids.shape[0]
        first = torch.searchsorted(instances, ids)
        counts = torch.searchsorted(instances, ids, right=True) - first
        offsets = torch.arange(top_k, device=ids.device)
        present = offsets < counts[:, None]  # [B, K]: the first counts[i] entries of instance i
        entries = (first[:, None] + offsets).clamp(max=instances.shape[0] - 1)
        # Absent entries write -1 into an extra column K, dropped at the end.
        slot = torch.where(present, slots[entries].long(), top_k)
        column = torch.where(present, columns[entries].long(), -1)
        out = torch.full((batch, top_k + 1), -1, dtype=torch.int64, device=ids.device)
        return out.scatter_(1, slot, column)[:, :top_k]


def _even_sizes(total: int, parts: int) -> list[int]:
    return [total // parts + (part < total % parts) for part in range(parts)]


def _invert(owner_table: torch.Tensor, shard: ClassShard, group: Group) -> tuple[torch.Tensor, ...]:
    """``(instances int64, slots int16, local columns int32)`` of the table entries whose negative this
    rank owns, sorted by instance id; the entries travel to their negative's owner in one all-to-all."""
    device = owner_table.device
    rows, top_k = owner_table.shape
    instances = (torch.arange(rows, device=device) + shard.class_start).repeat_interleave(top_k)
    slots = torch.arange(top_k, device=device).repeat(rows)
    negatives = owner_table.reshape(-1)
    owners = shard.owner_of(negatives)
    order = torch.argsort(owners, stable=True)
    packed = torch.stack([instances, slots, negatives])[:, order]
    if group is not None and group_size(group) > 1:
        send_counts = torch.bincount(owners, minlength=group_size(group))
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts, group=group)
        total = int(receive_counts.sum())
        receive_sizes, send_sizes = receive_counts.tolist(), send_counts.tolist()
        if isinstance(owner_table, FakeTensor):
            # The dry run's fake tensors hold no counts.  Hard negatives spread over every shard, so a
            # rank receives about as many entries as it sends: the index is sized as on a real run.
            total, receive_sizes = packed.shape[1], _even_sizes(packed.shape[1], group_size(group))
            send_sizes = receive_sizes
        received = torch.empty(total, 3, dtype=torch.int64, device=device)
        # all_to_all splits along dim 0, so each entry travels as one row of 3 fields.
        dist.all_to_all_single(received, packed.t().contiguous(), receive_sizes, send_sizes, group=group)
        packed = received.t()
    # A sentinel past every id (instance N) keeps the arrays non-empty for the fixed-shape lookup.
    sentinel = torch.tensor([[shard.num_classes], [0], [shard.class_start]], device=device)
    instances, slots, negatives = torch.cat([packed, sentinel], dim=1)
    order = torch.argsort(instances, stable=True)
    # Narrow types: this index lives as long as the epoch (int64 everywhere would be 24 bytes an entry).
    return instances[order], slots[order].to(torch.int16), (negatives[order] - shard.class_start).to(torch.int32)
