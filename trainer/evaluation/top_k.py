"""Choosing the k most similar bank rows under one tie rule: similarity descending, then the lower
instance id first.

``torch.topk`` leaves the order of equal values unspecified, so which of several equally similar
rows becomes the k-th neighbour could differ between one process scoring the whole bank and T
ranks each scoring a shard of it.  With the rule fixed, the k neighbours of a query are one
well-defined set, whatever the sharding, the block size or the device.
"""

from __future__ import annotations

import torch


def columns_by_similarity_then_id(similarities: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of ``similarities`` / ``ids`` (both ``[q, c]``), the column indices of its first
    ``min(k, c)`` entries ordered by similarity descending, then id ascending.

    Two stable sorts (by id, then by similarity) give the lexicographic order; it runs on candidate
    lists of a few times k columns, never on a bank.
    """
    by_id = ids.argsort(dim=1, stable=True)
    by_similarity = similarities.gather(1, by_id).argsort(dim=1, descending=True, stable=True)
    return by_id.gather(1, by_similarity)[:, :k]


def block_top_k_columns(similarities: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of ``similarities`` ``[q, b]`` (columns in ascending id order), the columns of its
    ``min(k, b)`` most similar entries, the lower column winning a tie for the last places.

    ``topk`` is exact except where more columns tie for the k-th value than there are places
    left; only those rows (rare outside duplicated images) are redone with a stable sort.  The
    order of the returned columns is not the tie rule's: callers order the candidates afterwards.
    """
    k = min(k, similarities.shape[1])
    values, columns = similarities.topk(k, dim=1)
    if k == 0:
        return columns
    crowded = (similarities >= values[:, -1:]).sum(dim=1) > k
    if crowded.any():
        rows = crowded.nonzero().squeeze(1)
        columns[rows] = similarities[rows].argsort(dim=1, descending=True, stable=True)[:, :k]
    return columns
