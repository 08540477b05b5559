"""Weighted k-nearest-neighbour classification on cosine similarity (the instance-discrimination
protocol): each of the k neighbours votes for its label with weight exp(similarity / t).

``knn_predict`` / ``knn_accuracy`` take a whole bank in one process; they are the one-rank case of
``sharded_knn`` (same tie rule, same votes), which the evaluation during and after training uses.
"""

from __future__ import annotations

import torch

from trainer.evaluation.sharded_knn import knn_bank_shard, sharded_neighbours, weighted_vote
from trainer.parallel.collectives import Group, gather_uneven_rows


@torch.no_grad()
def knn_predict(
    bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, k: int = 20, temperature: float = 0.07,
    chunk: int = 1024,
) -> torch.Tensor:
    ids = torch.arange(bank.shape[0], device=bank.device)
    shard = knn_bank_shard(bank, bank_labels, ids, None)
    return weighted_vote(sharded_neighbours(shard, queries, k, None, query_chunk=chunk), temperature, chunk)


def _require_query_labels(query_labels: torch.Tensor) -> None:
    if (query_labels < 0).any():
        raise ValueError("kNN evaluation needs labelled shards: data.eval_shards has unlabelled samples "
                         "(make-shards from a labelled source)")


def knn_accuracy(bank, bank_labels, queries, query_labels, k: int = 20, temperature: float = 0.07) -> float:
    _require_query_labels(query_labels)
    return float((knn_predict(bank, bank_labels, queries, k, temperature) == query_labels).float().mean())


@torch.no_grad()
def sharded_knn_accuracy(shard, queries: torch.Tensor, query_labels: torch.Tensor, k: int, temperature: float,
                         group: Group) -> float:
    """Collective: accuracy on every rank's held-out ``queries`` together (this rank's rows; they are
    all-gathered, every rank scoring them all against its own bank ``shard``)."""
    queries, query_labels = gather_uneven_rows(queries, group), gather_uneven_rows(query_labels, group)
    _require_query_labels(query_labels)
    predictions = weighted_vote(sharded_neighbours(shard, queries, k, group), temperature)
    return float((predictions == query_labels.to(predictions.device)).float().mean())
