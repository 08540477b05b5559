"""Shapes for torch's fused CUDA BatchNorm kernels on meta and fake tensors.

``batch_norm_stats``, ``batch_norm_backward_reduce`` and ``batch_norm_backward_elemt`` (what
``SyncBatchNorm`` runs on a GPU) have CUDA kernels only: torch registers no meta kernel for them, so
the dry run and the host-sync checks, which run the step on fake CUDA tensors, and ``torch.compile``'s
tracing could not follow them.  These kernels only say what the real ones return (shapes, dtypes,
devices; no values).  Registered once, when this module is imported, and only where torch has none.
"""

from __future__ import annotations

import torch

_STATISTICS_DTYPES = (torch.float64,)  # float64 input keeps float64 statistics; every other input fp32


def _statistics_dtype(input: torch.Tensor) -> torch.dtype:
    return input.dtype if input.dtype in _STATISTICS_DTYPES else torch.float32


def _stats(input, eps):
    channels = input.shape[1]
    dtype = _statistics_dtype(input)
    return input.new_empty(channels, dtype=dtype), input.new_empty(channels, dtype=dtype)


def _backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    channels = input.shape[1]
    if input_g:
        sum_dy, sum_dy_xmu = mean.new_empty(channels), mean.new_empty(channels)
    else:
        sum_dy = sum_dy_xmu = mean.new_empty(0)
    parameter_dtype = weight.dtype if weight is not None else mean.dtype
    grad_weight = mean.new_empty(channels if weight_g else 0, dtype=parameter_dtype)
    grad_bias = mean.new_empty(channels if bias_g else 0, dtype=parameter_dtype)
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def _backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    return torch.empty_like(input, memory_format=torch.preserve_format)


_KERNELS = {"batch_norm_stats": _stats, "batch_norm_backward_reduce": _backward_reduce,
            "batch_norm_backward_elemt": _backward_elemt}


def _register() -> torch.library.Library | None:
    missing = [name for name in _KERNELS
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta")]
    if not missing:
        return None
    library = torch.library.Library("aten", "IMPL")
    for name in missing:
        library.impl(name, _KERNELS[name], "Meta")
    return library


_LIBRARY = _register()  # kept alive: the registrations last as long as the library object
