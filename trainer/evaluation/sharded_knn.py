"""Weighted kNN over a bank and queries both sharded by rows: no rank ever holds more than its own
rows of either, and nothing it allocates grows with the queries times the ranks.

Each rank owns its queries.  They are scored in rounds: every rank contributes its next ``block``
queries (``query_chunk / T`` rows, zeros past its last), the blocks are all-gathered, and every rank
scores the ``T x block`` rows against its own bank shard, in blocks of bank rows so the similarity
matrix stays ``[T x block, bank_block]``, keeping each query's k best candidates.  An all-to-all
then sends each query's candidates to the rank that owns it, which selects k among the ``T x k``.
The global k nearest neighbours of a query are among the union of the ranks' k best (each of them
is in its own shard's k best), so selecting k again is exact.  One tie rule everywhere
(similarity descending, then lower instance id, see ``top_k``) makes the set the same for any
number of ranks; the votes are then added in that order, one neighbour at a time, so the
predictions equal the single-process ones bit for bit given the same similarities.
(Similarities come from float32 matmuls of different shapes than a whole-bank matmul; a BLAS that
changes its summation order with the shape could move a near-tie by one ulp.  The tests see none.)

Per rank the memory is its bank shard, its queries and their k neighbours, plus one round's
``T x block`` gathered rows and their candidates: ``knn_memory.knn_peak_bytes`` adds it up.

The bank may be stored in float16 (half the memory); rows are normalised and scored in float32,
so the result is then exactly the float32 kNN of the float16-rounded features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.evaluation.top_k import block_top_k_columns, columns_by_similarity_then_id
from trainer.parallel.collectives import Group, all_reduce_, gather_rows, group_size

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

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.similarities, self.ids, self.labels


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
    return Neighbours(*(values.gather(1, columns) for values in candidates.tensors()))


def _most_rows(rows: int, device: torch.device, group: Group) -> int:
    """Collective: the largest ``rows`` over the group (every rank runs as many rounds)."""
    most = torch.tensor([rows], device=device)
    return int(all_reduce_(most, dist.ReduceOp.MAX, group))


def _query_block(queries: torch.Tensor, start: int, rows: int, device: torch.device) -> torch.Tensor:
    """Normalised float32 queries ``[start, start + rows)``, zero rows past the last one (they score
    0 everywhere, and their neighbours are dropped)."""
    mine = F.normalize(queries[start : start + rows].to(device).float(), dim=1)
    if mine.shape[0] == rows:
        return mine
    return torch.cat([mine, mine.new_zeros((rows - mine.shape[0], mine.shape[1]))])


def _to_owners(candidates: Neighbours, group: Group) -> Neighbours:
    """Collective: rows ``[r x block, (r + 1) x block)`` of every rank's candidates go to rank r, which
    receives ``[T x block, k]``, the source ranks in order.  One all-to-all: the similarities' bits
    travel as int64 beside the ids and labels."""
    if group_size(group) == 1:
        return candidates
    k = candidates.ids.shape[1]
    packed = torch.cat([candidates.similarities.view(torch.int32).long(), candidates.ids, candidates.labels], dim=1)
    received = torch.empty_like(packed)
    dist.all_to_all_single(received, packed, group=group)
    return Neighbours(received[:, :k].int().view(torch.float32), received[:, k : 2 * k], received[:, 2 * k :])


@torch.no_grad()
def sharded_neighbours(shard: KnnBankShard, queries: torch.Tensor, k: int, group: Group,
                       query_chunk: int = 1024, bank_block: int = 65536,
                       most_queries: int | None = None) -> Neighbours:
    """Collective: the ``min(k, N)`` nearest bank rows (cosine) of this rank's ``queries`` ``[q, F]``
    over all shards (see the module docstring), ``[q, min(k, N)]`` each.

    ``query_chunk``: query rows scored at once on every rank, ``T x block`` with ``block =
    max(1, query_chunk // T)`` from each rank.  ``most_queries``: the most queries any rank holds,
    when the caller knows it (otherwise one all-reduce finds it).
    """
    if k < 1:
        raise ValueError(f"kNN needs k >= 1 neighbours, got {k}: set eval.knn_k to a positive number")
    device, ranks, rows = shard.features.device, group_size(group), queries.shape[0]
    if most_queries is None:
        most_queries = _most_rows(rows, device, group)
    block, kept = max(1, query_chunk // ranks), min(k, shard.total_rows)
    found = Neighbours(torch.empty((rows, kept), device=device), shard.ids.new_empty((rows, kept)),
                       shard.labels.new_empty((rows, kept)))
    for start in range(0, most_queries, block):
        scored = gather_rows(_query_block(queries, start, block, device), group)
        received = _to_owners(_shard_candidates(shard, scored, k, bank_block), group)
        # [T x block, k] in source-rank order -> [block, T x k]: each query's candidates side by side
        merged = Neighbours(*(values.reshape(ranks, block, k).permute(1, 0, 2).reshape(block, ranks * k)
                              for values in received.tensors()))
        best, end = _select(merged, kept), min(start + block, rows)
        if end > start:
            for into, values in zip(found.tensors(), best.tensors()):
                into[start:end] = values[: end - start]
    return found


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
