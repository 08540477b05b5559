"""Adds into rows of a tensor that give the same bits on every run, on CUDA too.

CUDA's ``scatter_add_`` and ``index_add_`` add with atomics: where two additions land on the same
element their order (and so the float result) changes from run to run, and a resumed run stops
being bit-identical to an uninterrupted one.  CUDA's ``index_put_(accumulate=True)`` sorts the
indices and sums each element's additions in index order instead: deterministic whether or not
``parallel.deterministic`` is on, for the price of a sort of the indices (B*(K+1) or a chunk's
rows, small next to the chunk's matmuls).  CPU kernels add in a fixed order, so CPU tensors keep
the plain ops (and their exact arithmetic).
"""

from __future__ import annotations

import torch


def _atomic(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s device adds with atomics (its plain scatter/index adds are not deterministic)."""
    return tensor.device.type != "cpu"


def add_into_rows(out: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``out[rows[k, b], b] += values[k, b]`` (``scatter_add_`` along dim 0); a row may repeat in a column."""
    if not _atomic(out):
        out.scatter_add_(0, rows, values)
        return
    columns = torch.arange(out.shape[1], device=out.device).expand_as(rows)
    out.index_put_((rows, columns), values, accumulate=True)


def add_rows(out: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, alpha: float = 1.0) -> None:
    """``out[rows[i]] += alpha * values[i]`` (``index_add_`` along dim 0); a row may repeat."""
    if not _atomic(out):
        out.index_add_(0, rows, values, alpha=alpha)
        return
    out.index_put_((rows,), values if alpha == 1.0 else values * alpha, accumulate=True)
