"""Base-2 logits, shared by both paths of the kernel: ``exp2(z log2 e) = exp(z)``, and ``exp2`` is
the faster instruction (~3x on CPUs; the GPU's special-function units compute exp2 natively)."""

from __future__ import annotations

import math

import torch

LOG2_E = math.log2(math.e)


def scales(temperature: float, dtype: torch.dtype) -> tuple[float, float]:
    """``(feature scale, weight scale)``, whose product ``log2(e)/tau`` turns cosines into base-2
    logits.  fp32 features take it all, once per pass.  Half-precision features are left exactly
    as given (rounding ``x log2(e)/tau`` again to bf16 would cost as much precision as the fp32
    matmul output saves): the scale rides on the weight rows' rounding to the half dtype, which
    each chunk does anyway (``trainer.classifier.kernel.half_matmul``)."""
    scale = LOG2_E / temperature
    return (scale, 1.0) if dtype == torch.float32 else (1.0, scale)
