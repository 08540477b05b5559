"""Weighted kNN over a bank sharded by rows: no rank ever holds more than its own N/T rows.

Every rank scores all queries (they are few and all-gathered) against its own shard, in blocks of
bank rows so the similarity matrix stays ``[query_chunk, bank_block]``, and keeps each query's k
best candidates.  The global k nearest neighbours of a query are among the union of the ranks'
k best (each of them is in its own shard's k best), so all-gathering the ``T x k`` candidates and
selecting k again is exact.  One tie rule everywhere (similarity descending, then lower instance
id, see ``top_k``) makes the set the same for any number of ranks; the votes are then added in
that order, one neighbour at a time, so the predictions equal the single-process ones bit for bit
given the same similarities.  (Similarities come from float32 matmuls of different shapes than a
whole-bank matmul; a BLAS that changes its summation order with the shape could move a near-tie
by one ulp.  The tests see none.)

The bank may be stored in float16 (half the memory); rows are normalised and scored in float32,
so the result is then exactly the float32 kNN of the float16-rounded features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.evaluation.top_k import block_top_k_columns, columns_by_similarity_then_id
from trainer.parallel.collectives import Group, gather_rows, group_size

NO_ID = torch.iinfo(torch.int64).max  # fills candidate lists of shards with fewer than k rows


@dataclass(frozen=True)
class KnnBankShard:
    """This rank's rows of the kNN bank.

    features: ``[n, F]`` raw backbone features (normalised when scored), in the storage dtype
        (``eval.bank_dtype``), on the rank's device.
    labels, ids: ``[n]`` int64 on the same device; ids ascending (the tie rule's order).
    total_rows: rows over all ranks (the bank's N), for ``k = min(k, N)``.
    """

    features: torch.Tensor
    labels: torch.Tensor
    ids: torch.Tensor
    total_rows: int


def knn_bank_shard(features: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor, group: Group) -> KnnBankShard:
    """Collective: this rank's rows as a shard, sorted by id; checks on every rank together that
    the whole bank is labelled (one rank raising alone would leave the others waiting)."""
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        order = ids.argsort()
        features, labels, ids = features[order], labels[order], ids[order]
    total = torch.tensor([labels.numel()], device=labels.device)
    most_negative = torch.tensor([-int(labels.min()) if labels.numel() else 0], device=labels.device)
    if group_size(group) > 1:
        dist.all_reduce(total, group=group)
        dist.all_reduce(most_negative, op=dist.ReduceOp.MAX, group=group)
    if int(most_negative) > 0:
        raise ValueError("kNN evaluation needs labelled shards: the bank has unlabelled samples (label -1); "
                         "make the shards from a labelled source (make-shards) or set data.knn_bank_shards")
    if int(total) == 0:
        raise ValueError("the kNN bank is empty: point data.knn_bank_shards (or data.train_shards) at a non-empty "
                         "shard set, and leave eval.bank_samples unset or positive")
    return KnnBankShard(features, labels, ids, int(total))


@dataclass(frozen=True)
class Neighbours:
    """The k nearest bank rows of every query, in the tie rule's order: ``[q, k]`` each."""

    similarities: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor


def _shard_candidates(shard: KnnBankShard, queries: torch.Tensor, k: int, bank_block: int) -> Neighbours:
    """This shard's k best rows for ``queries`` (normalised, float32), padded to k columns."""
    rows = queries.shape[0]
    best = Neighbours(queries.new_empty((rows, 0)), shard.ids.new_empty((rows, 0)), shard.labels.new_empty((rows, 0)))
    for start in range(0, shard.features.shape[0], bank_block):
        block = F.normalize(shard.features[start : start + bank_block].float(), dim=1)
        similarities = queries @ block.t()
        columns = block_top_k_columns(similarities, k)
        candidates = Neighbours(
            torch.cat([best.similarities, similarities.gather(1, columns)], dim=1),
            torch.cat([best.ids, shard.ids[start + columns]], dim=1),
            torch.cat([best.labels, shard.labels[start + columns]], dim=1),
        )
        best = _select(candidates, k)
    missing = k - best.ids.shape[1]  # a shard of fewer than k rows: pads that always lose
    return Neighbours(_pad(best.similarities, missing, float("-inf")), _pad(best.ids, missing, NO_ID),
                      _pad(best.labels, missing, 0))


def _pad(values: torch.Tensor, columns: int, fill) -> torch.Tensor:
    """``columns`` more columns of ``fill`` (F.pad passes its value as a double: int64's max overflows)."""
    return torch.cat([values, values.new_full((values.shape[0], columns), fill)], dim=1)


def _select(candidates: Neighbours, k: int) -> Neighbours:
    columns = columns_by_similarity_then_id(candidates.similarities, candidates.ids, k)
    return Neighbours(*(values.gather(1, columns) for values in
                        (candidates.similarities, candidates.ids, candidates.labels)))


@torch.no_grad()
def sharded_neighbours(shard: KnnBankShard, queries: torch.Tensor, k: int, group: Group,
                       query_chunk: int = 1024, bank_block: int = 65536) -> Neighbours:
    """Collective: the ``min(k, N)`` nearest bank rows (cosine) of every query over all shards.

    ``queries``: ``[q, F]``, the same on every rank.  Every rank returns the same result.
    """
    if k < 1:
        raise ValueError(f"kNN needs k >= 1 neighbours, got {k}: set eval.knn_k to a positive number")
    queries = F.normalize(queries.to(shard.features.device).float(), dim=1)
    parts = [_shard_candidates(shard, queries[start : start + query_chunk], k, bank_block)
             for start in range(0, queries.shape[0], query_chunk)]
    local = Neighbours(*(torch.cat(values) for values in zip(*((p.similarities, p.ids, p.labels) for p in parts))))
    if not parts:
        local = Neighbours(queries.new_empty((0, k)), shard.ids.new_empty((0, k)), shard.labels.new_empty((0, k)))
    ranks, rows = group_size(group), queries.shape[0]
    # [T * q, k] in rank order -> [q, T * k]: every query's candidates from every rank side by side
    merged = Neighbours(*(gather_rows(values, group).reshape(ranks, rows, k).permute(1, 0, 2).reshape(-1, ranks * k)
                          for values in (local.similarities, local.ids, local.labels)))
    return _select(merged, min(k, shard.total_rows))


def weighted_vote(neighbours: Neighbours, temperature: float, chunk: int = 1024) -> torch.Tensor:
    """Per query, the label with the largest sum of exp(similarity / t) over its neighbours (the
    first such label on a tie).  Neighbours are added one column at a time, in order: a scatter
    with one entry per row has no colliding atomics on a GPU, so the sums are deterministic and
    the same as a sequential CPU scatter's."""
    predictions = []
    for start in range(0, neighbours.labels.shape[0], chunk):
        labels = neighbours.labels[start : start + chunk]
        weights = torch.exp(neighbours.similarities[start : start + chunk] / temperature)
        votes = weights.new_zeros((labels.shape[0], int(labels.max()) + 1 if labels.numel() else 1))
        for column in range(labels.shape[1]):
            votes.scatter_add_(1, labels[:, column : column + 1], weights[:, column : column + 1])
        predictions.append(votes.argmax(dim=1))
    return torch.cat(predictions) if predictions else neighbours.labels.new_empty((0,))
