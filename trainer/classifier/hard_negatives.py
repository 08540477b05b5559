"""Top-K hardest label smoothing: the K most cosine-similar *other* rows of the sharded W.

Search (once per epoch): every rank queries with its own rows.  Each shard in turn is broadcast
to the group and scored against the local queries in (query, key) chunks, keeping a running
top-K, so no rank ever holds more than two shards or a ``[chunk, chunk]`` score block — never N x N.

Lookup (every step): the table is sharded like W (rows of the classes a rank owns).  A step needs
the hard negatives of its local samples, whose owners are anywhere: ids are gathered over the
classifier group, each owner fills the rows it has, and one SUM all-reduce completes the table.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.classifier.sharding import ClassShard
from trainer.parallel.collectives import Group, all_reduce_, gather_rows, group_rank, group_size


@torch.no_grad()
def search_hard_negatives(
    weight_local: torch.Tensor,
    shard: ClassShard,
    group: Group,
    top_k: int,
    query_chunk: int = 8192,
    key_chunk: int = 65536,
) -> torch.Tensor:
    """``[N_local, K]`` int64 global ids of the K most similar other rows of each local row."""
    if top_k > shard.num_classes - 1:
        raise ValueError(f"smoothing_top_k={top_k} needs at least {top_k + 1} instances, have {shard.num_classes}")
    queries = F.normalize(weight_local.float(), dim=1)
    device = queries.device
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
        for key_start in range(0, keys.shape[0], key_chunk):
            key_block = keys[key_start : key_start + key_chunk]
            key_ids = torch.arange(key_block.shape[0], device=device) + source_shard.class_start + key_start
            for q_start in range(0, queries.shape[0], query_chunk):
                q_end = min(q_start + query_chunk, queries.shape[0])
                scores = queries[q_start:q_end] @ key_block.t()
                scores.masked_fill_(query_ids[q_start:q_end, None] == key_ids[None, :], float("-inf"))  # never yourself
                merged_scores = torch.cat([best_scores[q_start:q_end], scores], dim=1)
                merged_ids = torch.cat([best_ids[q_start:q_end], key_ids.expand(q_end - q_start, -1)], dim=1)
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
