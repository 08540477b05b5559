"""Weighted k-nearest-neighbour classification on cosine similarity (the instance-discrimination
protocol): each of the k neighbours votes for its label with weight exp(similarity / t).

``knn_predict`` / ``knn_accuracy`` take a whole bank in one process; they are the one-rank case of
``sharded_knn`` (same tie rule, same votes), which the evaluation during and after training uses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.evaluation.sharded_knn import knn_bank_shard, sharded_neighbours, weighted_vote
from trainer.parallel.collectives import Group, all_reduce_


@torch.no_grad()
def knn_predict(
    bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, k: int = 20, temperature: float = 0.07,
    chunk: int = 1024,
) -> torch.Tensor:
    ids = torch.arange(bank.shape[0], device=bank.device)
    shard = knn_bank_shard(bank, bank_labels, ids, None)
    return weighted_vote(sharded_neighbours(shard, queries, k, None, query_chunk=chunk), temperature, chunk)


def _require_query_labels(unlabelled) -> None:
    if unlabelled:
        raise ValueError("kNN evaluation needs labelled shards: data.eval_shards has unlabelled samples "
                         "(make-shards from a labelled source)")


def knn_accuracy(bank, bank_labels, queries, query_labels, k: int = 20, temperature: float = 0.07) -> float:
    _require_query_labels(bool((query_labels < 0).any()))
    return _fraction(int((knn_predict(bank, bank_labels, queries, k, temperature) == query_labels).sum()),
                     len(query_labels))


def _fraction(correct: int, total: int) -> float:
    return correct / total if total else float("nan")


@torch.no_grad()
def sharded_knn_accuracy(shard, queries: torch.Tensor, query_labels: torch.Tensor, k: int, temperature: float,
                         group: Group) -> float:
    """Collective: accuracy on every rank's held-out ``queries`` together, each rank finding and
    voting the neighbours of its own rows (``sharded_neighbours``); only counts are summed."""
    device = shard.features.device
    query_labels = query_labels.to(device)
    # One all-reduce: the most queries on a rank (the rounds) and whether any rank has an unlabelled one
    status = torch.tensor([queries.shape[0], 0], device=device)
    status[1:] = (query_labels < 0).any()
    most_queries, unlabelled = all_reduce_(status, dist.ReduceOp.MAX, group).tolist()
    _require_query_labels(unlabelled)
    predictions = weighted_vote(sharded_neighbours(shard, queries, k, group, most_queries=most_queries),
                                temperature)
    counts = torch.stack([(predictions == query_labels).sum(), torch.tensor(queries.shape[0], device=device)])
    correct, total = all_reduce_(counts, dist.ReduceOp.SUM, group).tolist()
    return _fraction(correct, total)
