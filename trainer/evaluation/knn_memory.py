"""The device memory one rank of the sharded kNN (``sharded_knn``) needs at its peak, from the sizes
alone: what ``instcls plan``-style figures are made of, and what the fake-device test checks the
executed kNN against.

Every term is per rank and none grows with the queries times the ranks: a rank holds its shard of
the bank, its own queries and their neighbours, and one round's ``T x block`` gathered query rows
scored against one block of bank rows.  The scoring term is an upper bound: it assumes every query
row of a block ties for its k-th neighbour (duplicated images), so that ``block_top_k_columns``
re-sorts the whole block instead of keeping ``topk``'s answer.
"""

from __future__ import annotations

FLOAT32, INT64 = 4, 8
CANDIDATE = FLOAT32 + 2 * INT64  # one neighbour: similarity, id, label
# Per element of a [rows, bank rows] similarity block at its worst: the similarities, topk's tie
# mask (bool), the tied rows' copy, and their stable sort (values and int64 indices).
SCORING_PER_SIMILARITY = FLOAT32 + 1 + FLOAT32 + FLOAT32 + INT64
CANDIDATE_COPIES = 6  # a candidate list is concatenated, packed, exchanged, merged and sorted by id and value
VOTE_CHUNK = 1024  # ``weighted_vote``'s rows at once


def knn_memory_breakdown(queries: int, bank_rows: int, dim: int, k: int, ranks: int, query_chunk: int = 1024,
                         bank_block: int = 65536, bank_element_bytes: int = 2, classes: int = 1000) -> dict[str, int]:
    """Bytes per rank, by part, of scoring ``queries`` held-out rows against a bank of ``bank_rows``
    (both spread evenly over ``ranks``; the largest share is counted), ``dim`` features, ``k``
    neighbours; ``query_chunk`` and ``bank_block`` as ``sharded_neighbours`` takes them;
    ``bank_element_bytes``: 2 for ``eval.bank_dtype: float16``, 4 for float32; ``classes``: labels."""
    own_queries, own_bank = -(-queries // ranks), -(-bank_rows // ranks)
    rows = ranks * max(1, query_chunk // ranks)  # query rows scored per round, over all ranks
    bank_rows_at_once = min(bank_block, own_bank)
    return {
        "bank shard (features, ids, labels)": own_bank * (dim * bank_element_bytes + 2 * INT64),
        "own queries (float32) and labels": own_queries * (dim * FLOAT32 + INT64),
        "own queries' neighbours and predictions": own_queries * (k * CANDIDATE + 2 * INT64),
        "a round's gathered query rows (normalised, padded)": 3 * rows * dim * FLOAT32,
        "a bank block in float32 (read, normalised)": 2 * bank_rows_at_once * dim * FLOAT32,
        "a round's similarities and tie sorts (worst case)": rows * bank_rows_at_once * SCORING_PER_SIMILARITY,
        "a round's candidates (exchanged, merged)": CANDIDATE_COPIES * rows * 2 * k * CANDIDATE,
        "a vote chunk": VOTE_CHUNK * (classes + k) * FLOAT32,
    }


def knn_peak_bytes(queries: int, bank_rows: int, dim: int, k: int, ranks: int, query_chunk: int = 1024,
                   bank_block: int = 65536, bank_element_bytes: int = 2, classes: int = 1000) -> int:
    """The sum of ``knn_memory_breakdown``: an upper bound on one rank's device memory during the kNN."""
    return sum(knn_memory_breakdown(queries, bank_rows, dim, k, ranks, query_chunk, bank_block, bank_element_bytes,
                                    classes).values())

