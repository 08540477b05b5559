"""BatchNorm that runs with bf16 parameters and fp32 running statistics, as DeepSpeed leaves them.

DeepSpeed's bf16 engine (0.19) casts a module's parameters to bf16 and leaves its buffers in fp32.
A BatchNorm layer then holds a bf16 weight and bias next to fp32 running statistics, and no
``batch_norm`` kernel takes that mix: PyTorch's raises "expected scalar type BFloat16 but found
Float" on the CPU and, on a GPU, for an NCHW input (found by the first GPU run, docs/gpu-results.md;
its NHWC kernel let it through).  Casting the statistics to bf16 would keep 8 bits of the running
variance that evaluation normalises with.  Instead the layer hands the kernel fp32 copies of its
weight and bias (2 x C numbers): low-precision input, fp32 parameters and statistics is the mix
PyTorch's kernels are written for (what autocast does), and the output keeps the input's dtype.
Gradients flow to the bf16 parameters through the casts.  State-dict names do not change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Fp32AffineBatchNorm:
    # plain BatchNorm maths: model.batch_norm=sync may convert it (trainer.parallel.sync_batch_norm)
    same_maths_as_batch_norm = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if (self.weight is None or self.running_mean is None or self.momentum is None
                or self.weight.dtype == self.running_mean.dtype):
            return super().forward(input)
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight.float(), self.bias.float(),
                            self.training, self.momentum, self.eps)


class BatchNorm1d(_Fp32AffineBatchNorm, nn.BatchNorm1d):
    pass


class BatchNorm2d(_Fp32AffineBatchNorm, nn.BatchNorm2d):
    pass


_REPLACEMENTS = {nn.BatchNorm1d: BatchNorm1d, nn.BatchNorm2d: BatchNorm2d}


def accept_low_precision_parameters(model: nn.Module) -> nn.Module:
    """Every plain BatchNorm1d/2d of ``model`` in place becomes the class above (same state)."""
    for module in model.modules():
        replacement = _REPLACEMENTS.get(type(module))
        if replacement is not None:
            module.__class__ = replacement
    return model
