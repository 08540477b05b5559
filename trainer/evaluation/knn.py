"""Weighted k-nearest-neighbour classification on cosine similarity (the instance-discrimination
protocol): each of the k neighbours votes for its label with weight exp(similarity / t)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def knn_predict(
    bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, k: int = 20, temperature: float = 0.07,
    chunk: int = 1024,
) -> torch.Tensor:
    bank = F.normalize(bank.float(), dim=1)
    queries = F.normalize(queries.float(), dim=1)
    num_classes = int(bank_labels.max()) + 1
    k = min(k, bank.shape[0])
    predictions = []
    for start in range(0, queries.shape[0], chunk):
        similarity, neighbour = (queries[start : start + chunk] @ bank.t()).topk(k, dim=1)
        votes = torch.zeros(similarity.shape[0], num_classes)
        votes.scatter_add_(1, bank_labels[neighbour], torch.exp(similarity / temperature))
        predictions.append(votes.argmax(dim=1))
    return torch.cat(predictions)


def knn_accuracy(bank, bank_labels, queries, query_labels, k: int = 20, temperature: float = 0.07) -> float:
    if (bank_labels < 0).any() or (query_labels < 0).any():
        raise ValueError("kNN evaluation needs labelled shards (make-shards from a labelled source)")
    return float((knn_predict(bank, bank_labels, queries, k, temperature) == query_labels).float().mean())
