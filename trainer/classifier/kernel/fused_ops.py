"""The fused kernels as PyTorch custom ops (``torch.library.custom_op``) with fake implementations.

As ops, the kernels are one node each to ``torch.compile`` and run under ``FakeTensorMode``: the
dry run (``instcls dry-run``, fake CUDA devices, no GPU) executes the fused path's step with these
fake implementations, so its memory is the fused path's.  Every output buffer is allocated by the
caller and passed in (the ops mutate it), so the dry run's memory tracker sees each of them.
``rows_key``: the rows part of the autotune key (``fused.autotune_rows_key``; 0: from the op's rows).
Triton is imported when a kernel first runs, never on the chunked path.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _kernels():
    from trainer.classifier.kernel import fused_triton

    return fused_triton


@torch.library.custom_op("instcls::cosine_sum_exp", mutates_args=("partial",))
def cosine_sum_exp(features: Tensor, weight: Tensor, rows: Optional[Tensor], offset: int, count: int,
                   inv_norm: Tensor, weight_scale: float, partial: Tensor, rows_key: int = 0) -> None:
    _kernels().sum_exp(features, weight, rows, offset, count, inv_norm, weight_scale, partial, rows_key)


@torch.library.custom_op("instcls::cosine_grad_features", mutates_args=("partial",))
def cosine_grad_features(features: Tensor, weight: Tensor, rows: Optional[Tensor], offset: int, count: int,
                         inv_norm: Tensor, weight_scale: float, coef: Tensor, shift: Tensor, partial: Tensor,
                         rows_key: int = 0) -> None:
    _kernels().grad_features(features, weight, rows, offset, count, inv_norm, weight_scale, coef, shift, partial,
                             rows_key)


@torch.library.custom_op("instcls::cosine_grad_rows", mutates_args=("out",))
def cosine_grad_rows(features: Tensor, weight: Tensor, rows: Optional[Tensor], offset: int, start: int, end: int,
                     inv_norm: Tensor, weight_scale: float, coef: Tensor, shift: Tensor, grad_scale: float,
                     out: Tensor, rows_key: int = 0) -> None:
    _kernels().grad_rows(features, weight, rows, offset, start, end, inv_norm, weight_scale, coef, shift,
                         grad_scale, out, rows_key)


# The fake implementations: the outputs are the caller's buffers, so there is nothing to allocate.
@cosine_sum_exp.register_fake
def _(features, weight, rows, offset, count, inv_norm, weight_scale, partial, rows_key=0) -> None:
    return None


@cosine_grad_features.register_fake
def _(features, weight, rows, offset, count, inv_norm, weight_scale, coef, shift, partial, rows_key=0) -> None:
    return None


@cosine_grad_rows.register_fake
def _(features, weight, rows, offset, start, end, inv_norm, weight_scale, coef, shift, grad_scale, out,
      rows_key=0) -> None:
    return None
