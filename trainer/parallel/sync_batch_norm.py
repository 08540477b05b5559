"""BatchNorm whose training-mode statistics are the batch of every rank of a group (the data-parallel
group, or the ranks of one node: ``model.sync_batch_norm_group``), on any device and backend (NCCL,
gloo CPU ranks), with no host read in the forward or the backward.

``torch.nn.SyncBatchNorm`` refuses CPU tensors and, on a GPU, reads the gathered per-rank counts on
the host (it drops the ranks that held no samples with a boolean mask), so the CPU waits for the
device once per layer: ~53 times per ResNet-50 forward.  Here a rank that held no samples simply
counts zero in every sum, so the shapes never depend on the data.

Forward, per channel: each rank's count, mean and sum of squared deviations, one all-gather of a
``[ranks, 2C + 1]`` row, and their exact combination into the group's mean and variance
(``trainer.parallel.batch_norm_pieces``, where the per-rank maths lives, with torch's fused CUDA
kernels on a GPU).  The biased variance normalises; the unbiased one (``N - 1``) enters the running
variance, as PyTorch's BatchNorm does.  Every rank of the group combines the same gathered rows, so
their running statistics move identically.

Backward (``_NormalizeWithGroupStatistics``): the gradient flows through the group's statistics, so
each layer all-reduces ``[sum dy, sum dy * (x - mean)]`` (2C values).  The weight and bias gradients
are this rank's sums, as for any parameter: the data-parallel gradient reduction adds the ranks'
parts.

Precision: with DeepSpeed's bf16 engine a layer holds bf16 weight and bias next to fp32 running
statistics; the arithmetic runs in fp32 (the affine parameters cast, 2 x C numbers), the output in the
input's dtype, gradients back in each parameter's own dtype.

Without a group of more than one rank (a one-process run, a node of one rank) the layer is plain
BatchNorm: ``F.batch_norm`` with the same fp32 handling of the affine parameters.
``synchronize_alone`` keeps the synchronised path on a group of one: a one-GPU check then runs the
code (and the kernels) that a multi-rank job runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainer.parallel.batch_norm_pieces import (
    combine_rows,
    gradient_sums,
    input_gradient,
    parameter_gradients,
    rank_row,
)
from trainer.parallel.collectives import all_reduce_, gather_rows


def global_batch_statistics(input: torch.Tensor, group: dist.ProcessGroup | None, dtype: torch.dtype,
                            eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, biased variance, unbiased variance, count)`` per channel over every rank's ``input``
    (``count`` a one-element tensor), in ``dtype``: one all-gather, no host read."""
    every_rank = gather_rows(rank_row(input, dtype, eps).unsqueeze(0), group)  # [ranks, 1 + C + C]
    return combine_rows(every_rank, input.shape[1])


class _NormalizeWithGroupStatistics(torch.autograd.Function):
    """Forward: ``(x - mean) / sqrt(var + eps) * weight + bias`` with the group's ``mean`` and ``var``
    (given), in their dtype, the output in ``x``'s.  Backward: the exact gradient of that through the
    group's statistics (one all-reduce of 2C sums over ``group``); the weight and bias get this
    rank's sums."""

    @staticmethod
    def forward(ctx, input, weight, bias, mean, variance, count, eps, group):
        dtype = mean.dtype
        affine_weight = None if weight is None else weight.to(dtype)
        affine_bias = None if bias is None else bias.to(dtype)
        invstd = (variance + eps).rsqrt()
        ctx.save_for_backward(input, affine_weight, mean, invstd, count)
        ctx.group = group
        ctx.parameter_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        # the inference kernel: normalises with the given statistics, low-precision input welcome
        return F.batch_norm(input, mean, variance, affine_weight, affine_bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd, count = ctx.saved_tensors
        own = gradient_sums(grad_output, input, mean, invstd)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            every_rank = all_reduce_(own.clone(), dist.ReduceOp.SUM, ctx.group)
            grad_input = input_gradient(grad_output, input, mean, invstd, weight, every_rank, count)
        own_weight, own_bias = parameter_gradients(own, invstd)
        weight_dtype, bias_dtype = ctx.parameter_dtypes
        if ctx.needs_input_grad[1]:
            grad_weight = own_weight.to(weight_dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = own_bias.to(bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the batch of every rank of ``process_group`` (None: the default group, when
    one is initialised), for inputs ``[N, C, ...]`` of any rank >= 2 (BatchNorm1d/2d/3d alike).
    State-dict names are BatchNorm's.  ``synchronize_alone``: the synchronised path on a group of one
    rank too (one-GPU checks).  See the module docstring."""

    synchronize_alone = False

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None,
                 device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions [N, C, ...], got {input.dim()}")

    def _synchronized_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks share the statistics, or None when this rank is alone."""
        group = self.process_group
        if group is None:
            if not (dist.is_available() and dist.is_initialized()):
                return None
            group = dist.group.WORLD
        return group if self.synchronize_alone or dist.get_world_size(group) > 1 else None

    def _statistics_dtype(self, input: torch.Tensor) -> torch.dtype:
        if self.running_mean is not None:
            return self.running_mean.dtype
        return torch.promote_types(input.dtype, torch.float32)

    def _affine(self, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Weight and bias in the statistics' dtype (bf16 parameters next to fp32 statistics: no
        ``batch_norm`` kernel takes that mix)."""
        if self.weight is None or self.weight.dtype == dtype:
            return self.weight, self.bias
        return self.weight.to(dtype), self.bias.to(dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        group = self._synchronized_group() if self.training else None
        if group is None:
            return self._local_forward(input)
        dtype = torch.promote_types(input.dtype, torch.float32)
        with torch.no_grad():
            mean, variance, unbiased_variance, count = global_batch_statistics(input, group, dtype, self.eps)
            if self.track_running_stats and self.running_mean is not None:
                self.num_batches_tracked.add_(1)
                # momentum None: the cumulative average, its factor a device tensor (no host read)
                factor = (self.momentum if self.momentum is not None
                          else self.num_batches_tracked.to(self.running_mean.dtype).reciprocal())
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased_variance.to(self.running_var.dtype), factor)
        return _NormalizeWithGroupStatistics.apply(input, self.weight, self.bias, mean, variance, count,
                                                    self.eps, group)

    def _local_forward(self, input: torch.Tensor) -> torch.Tensor:
        """``torch.nn.BatchNorm``'s forward, with the affine parameters in the statistics' dtype."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_statistics = self.training or (self.running_mean is None and self.running_var is None)
        use_running = not self.training or self.track_running_stats
        weight, bias = self._affine(self._statistics_dtype(input))
        return F.batch_norm(input, self.running_mean if use_running else None,
                            self.running_var if use_running else None, weight, bias, batch_statistics, factor,
                            self.eps)


def _converts_as_plain_batch_norm(cls: type) -> bool:
    """Whether a BatchNorm class computes plain BatchNorm (so becoming ``SyncBatchNorm`` keeps its
    maths): torch's own, or a subclass that says so with ``same_maths_as_batch_norm = True``.  A
    subclass that adds work to its forward (timm's ``BatchNormAct2d`` applies an activation) would
    silently lose it."""
    return (cls.forward in (_BatchNorm.forward, nn.SyncBatchNorm.forward)
            or getattr(cls, "same_maths_as_batch_norm", False))


def convert_to_sync_batch_norm(model: nn.Module, process_group: dist.ProcessGroup | None = None,
                               synchronize_alone: bool = False) -> nn.Module:
    """Every BatchNorm layer of ``model`` becomes a ``SyncBatchNorm`` over ``process_group``, in place:
    the same parameter and buffer tensors under the same state-dict names, so checkpoints load
    either way.  Refuses a BatchNorm subclass whose forward does more than BatchNorm."""
    for name, module in model.named_modules():
        if not isinstance(module, _BatchNorm) or isinstance(module, SyncBatchNorm):
            continue
        if not _converts_as_plain_batch_norm(type(module)):
            raise ValueError(f"model.batch_norm=sync cannot convert {name or 'the model'} "
                             f"({type(module).__qualname__}): its forward does more than BatchNorm. Use "
                             "model.batch_norm=local, or set same_maths_as_batch_norm = True on the class if "
                             "its forward is plain BatchNorm")
        module.__class__ = SyncBatchNorm
        module.process_group = process_group
        module.synchronize_alone = synchronize_alone
    return model
