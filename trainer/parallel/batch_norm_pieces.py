"""The per-rank pieces of BatchNorm over several ranks' batches, with the collectives left out, so the
same functions serve ``SyncBatchNorm`` (with an all-gather and an all-reduce between them) and a
one-process check that splits a batch into pseudo-ranks (``trainer/bench/sync_batch_norm_check.py``,
which ``scripts/gpu_check.sh syncbn`` runs on a lent GPU).

Forward: each rank's ``rank_row`` (count, mean, sum of squared deviations per channel) and
``combine_rows`` over every rank's row: Chan et al.'s pairwise combination, exact for unequal
batches and stable for channels with a large mean; a rank that held no samples counts zero in
every sum (never a NaN, and no host-side mask).

Backward: each rank's ``gradient_sums`` (``[sum dy, sum dy * (x - mean)]``, 2C values), summed over
the ranks, and ``input_gradient`` from those global sums:
``dx = w * invstd * (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean)))``.

On CUDA the work runs in torch's fused BatchNorm kernels (``batch_norm_stats``,
``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``, as ``torch.nn.SyncBatchNorm`` uses
them): no full-size temporary, bf16 and channels_last read in place.  Those kernels exist for CUDA
only, so the CPU runs the same maths as plain tensor expressions (fp32 or float64 temporaries), which
the float64 tests check.  An empty rank takes the tensor path on either device.
"""

from __future__ import annotations

import torch

import trainer.parallel.batch_norm_meta  # noqa: F401  (the fused kernels on fake tensors: the dry run)


def reduced_dims(input: torch.Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


def per_channel(tensor: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """A ``[C]`` tensor shaped to broadcast against ``input`` ``[N, C, ...]``."""
    return tensor.view(1, -1, *([1] * (input.dim() - 2)))


def _fused(input: torch.Tensor) -> bool:
    return input.is_cuda and input.numel() > 0


def rank_row(input: torch.Tensor, dtype: torch.dtype, eps: float) -> torch.Tensor:
    """``[1 + 2C]``: this rank's sample count per channel, mean and sum of squared deviations, in
    ``dtype`` (zeros for an empty batch)."""
    channels = input.shape[1]
    count = input.numel() // channels if channels else 0
    if _fused(input):
        mean, invstd = torch.batch_norm_stats(input, eps)  # fp32 (float64 for float64 input)
        variance = invstd.to(dtype).pow(-2) - eps
        mean = mean.to(dtype)
    elif input.numel() > 0:
        variance, mean = torch.var_mean(input.to(dtype), dim=reduced_dims(input), correction=0)
    else:
        mean = variance = torch.zeros(channels, dtype=dtype, device=input.device)
    count_column = torch.full((1,), count, dtype=dtype, device=input.device)
    return torch.cat([count_column, mean, variance * count])


def combine_rows(every_rank: torch.Tensor, channels: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, biased variance, unbiased variance, count)`` per channel of the union of the batches
    whose ``rank_row`` are the rows of ``every_rank`` ``[ranks, 1 + 2C]`` (``count`` one element)."""
    counts, means, deviations = every_rank.split([1, channels, channels], dim=1)
    total = counts.sum(0)
    mean = (counts * means).sum(0) / total
    # Chan et al.: the sum of squared deviations from the global mean, rank by rank
    squared_deviations = deviations.sum(0) + (counts * (means - mean).square()).sum(0)
    return mean, squared_deviations / total, squared_deviations / (total - 1), total


def _like_input(grad: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """The kernels want the gradient in the input's memory layout."""
    if input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last):
        return grad.contiguous(memory_format=torch.channels_last)
    return grad.contiguous()


def gradient_sums(grad: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor
                  ) -> torch.Tensor:
    """``[2C]``: this rank's ``[sum dy, sum dy * (x - mean)]`` in the statistics' dtype."""
    if _fused(input):
        sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(
            _like_input(grad, input), input, mean, invstd, None, True, False, False)
        return torch.cat([sum_dy, sum_dy_xmu]).to(mean.dtype)
    dims = reduced_dims(input)
    grad = grad.to(mean.dtype)
    centred = input.to(mean.dtype) - per_channel(mean, input)
    return torch.cat([grad.sum(dims), (grad * centred).sum(dims)])


def input_gradient(grad: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                   weight: torch.Tensor | None, sums: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``dx`` in the input's dtype from the ``sums`` of every rank's ``gradient_sums`` and the global
    ``count``; ``weight`` (None: no affine) in the statistics' dtype."""
    sum_dy, sum_dy_xmu = sums.chunk(2)
    if _fused(input):
        return torch.batch_norm_backward_elemt(_like_input(grad, input), input, mean, invstd, weight, sum_dy,
                                               sum_dy_xmu, count.to(torch.int32))
    mean_dy, mean_dy_xmu = sum_dy / count, sum_dy_xmu / count
    scale = invstd if weight is None else invstd * weight
    centred = input.to(mean.dtype) - per_channel(mean, input)
    grad_input = (grad.to(mean.dtype) - per_channel(mean_dy, input)
                  - centred * per_channel(invstd.square() * mean_dy_xmu, input))
    return (grad_input * per_channel(scale, input)).to(input.dtype)


def parameter_gradients(sums: torch.Tensor, invstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d weight, d bias)`` of this rank's part, from its own ``gradient_sums`` (the data-parallel
    gradient reduction adds the ranks' parts, as for any parameter)."""
    sum_dy, sum_dy_xmu = sums.chunk(2)
    return sum_dy_xmu * invstd, sum_dy
