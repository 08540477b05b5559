"""The fused classifier kernels in Triton: logits tiles that live in registers and never reach memory.

Three kernels over one rank's scored rows (``ScoredRows``: all local rows, a window, or sampled rows
by index) and the gathered features ``x`` ``[B, D]``:

- ``_sum_exp_kernel`` (forward): each program holds a block of features and walks its share of the
  row tiles: ``s = x . (w * inv_norm * weight_scale)^T`` (base-2 logits, fp32 accumulation), ``exp2``,
  summed over the tile's rows into the block's running sum.  No max is kept: features and rows are
  unit vectors, so ``|z| <= 1/tau`` (the chunked kernel's bounded-logit argument).  Programs split
  the row tiles ``SPLITS`` ways and write partial sums ``[SPLITS, B]``, summed afterwards in a fixed
  order: deterministic, and enough programs to fill the device at a batch of a few thousand.
- ``_grad_features_kernel`` (backward, FlashAttention-2's dQ): the same tiles recomputed,
  ``p = coef * exp2(s - shift)``, and ``dx += p . w_hat``: partial ``[SPLITS, B, D]`` again.
- ``_grad_rows_kernel`` (backward, FlashAttention-2's dK): each program holds a block of rows and
  walks every feature block, ``g += p^T . x``, then applies the backward of ``w / |w|`` (removes
  the radial part, divides by the norm) and writes the rows' gradient.

Recomputing each tile in both backward kernels executes 10 matmul FLOPs per 6 useful ones; one
backward kernel with atomic adds would recompute once but add in a run-dependent order, which
breaks bit-identical resumes (``parallel.deterministic``).  Not written: see docs/benchmarks.md.

Operands are the features' dtype (bf16/fp16 on tensor cores; fp32 as three TF32 products, fp32's accuracy), the
weight rows are normalised and scaled in fp32 and rounded once to that dtype, as the chunked
kernel's ``HalfOperands`` does; every accumulation is fp32.  Import this module only where Triton
can run: CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set before ``triton`` is imported.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# INSTCLS_FUSED_AUTOTUNE=0: every launch takes each kernel's first config (no compile of the other
# candidates: the GPU tests check numbers, not speed).
AUTOTUNE = os.environ.get("INSTCLS_FUSED_AUTOTUNE", "1") != "0"


def _configs(*shapes: tuple[int, int, int, int]) -> list[triton.Config]:
    """``(BLOCK_B, BLOCK_N, warps, stages)`` candidates that ``triton.autotune`` times on the first
    launch of each key (D, operand type, row subset kind) in a process; the interpreter gets one small
    config (every program is numpy work there, and ``tl.dot`` needs 16)."""
    if INTERPRETED:
        return [triton.Config(dict(BLOCK_B=16, BLOCK_N=16))]
    return [triton.Config(dict(BLOCK_B=b, BLOCK_N=n), num_warps=w, num_stages=st) for b, n, w, st in shapes]


# (BLOCK_B, BLOCK_N, warps, stages) with D = 128 and bf16 operands that compile for sm_90 without a
# register spill (ptxas -v, no GPU needed).  fp32 operands take the same candidates; those beyond
# the 227 KB of shared memory are skipped by the autotuner.  The first of each list is what runs
# untuned (deterministic runs, INSTCLS_FUSED_AUTOTUNE=0): it fits with fp32 operands too.
_SUM_EXP_CONFIGS = _configs((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 2), (64, 64, 4, 3))
_GRAD_FEATURES_CONFIGS = _configs((128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 2))
_GRAD_ROWS_CONFIGS = _configs((128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3))
# Tuned once per feature width, operand type, row-subset kind and power-of-two sizes of the batch and
# the rows (a step's shapes repeat; where the rows vary by step, as PIC's sampled rows do, the caller
# passes one rows key for the whole run: ``fused.autotune_rows_key``).
_KEY = ["D", "HAS_ROWS", "DOT", "batch_bucket", "rows_bucket"]


@triton.jit
def _load_rows(w_ptr, rows_ptr, inv_norm_ptr, pos, offset, count, stride_w, D,
               HAS_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 ``w / |w|`` of the scored positions ``pos`` (zero rows past ``count``)."""
    in_range = pos < count
    if HAS_ROWS:  # noqa: SIM108 - an if on a constexpr is resolved when the kernel compiles
        row = tl.load(rows_ptr + pos, mask=in_range, other=0)
    else:
        row = offset + pos
    d = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + row[:, None].to(tl.int64) * stride_w + d[None, :],
                mask=in_range[:, None] & (d[None, :] < D), other=0.0)
    inv_norm = tl.load(inv_norm_ptr + pos, mask=in_range, other=0.0)
    return w * inv_norm[:, None], in_range


HALF, FP32, HALF_VALUES_IN_FP32 = 0, 1, 2  # how ``_dot`` multiplies (the kernels' DOT argument)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """fp32-accumulated product: half operands on tensor cores, fp32 ones as three TF32 products
    (``tf32x3``: fp32's accuracy on tensor cores; IEEE fp32 dots spill registers at these tiles), or
    half values held in fp32 (the interpreter, whose bf16 ``tl.dot`` returns garbage in
    Triton 3.8; a product of two bf16 numbers is exact in fp32, so the numbers are the GPU's up to
    summation order)."""
    if DOT == 1:
        return tl.dot(a, b, input_precision="tf32x3")
    if DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.autotune(configs=_SUM_EXP_CONFIGS, key=_KEY)
@triton.jit
def _sum_exp_kernel(x_ptr, w_ptr, rows_ptr, inv_norm_ptr, partial_ptr, B, D, count, offset, stride_x, stride_w,
                    weight_scale, batch_bucket, rows_bucket, HAS_ROWS: tl.constexpr, DOT: tl.constexpr,
                    SPLITS: tl.constexpr,
                    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_b, split = tl.program_id(0), tl.program_id(1)
    b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + b[:, None] * stride_x + d[None, :], mask=(b[:, None] < B) & (d[None, :] < D), other=0.0)
    total = tl.zeros([BLOCK_B], dtype=tl.float32)
    for tile in range(split, tl.cdiv(count, BLOCK_N), SPLITS):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        w_hat, in_range = _load_rows(w_ptr, rows_ptr, inv_norm_ptr, pos, offset, count, stride_w, D, HAS_ROWS,
                                     BLOCK_D)
        s = _dot(x, tl.trans((w_hat * weight_scale).to(x.dtype)), DOT)
        total += tl.sum(tl.where(in_range[None, :], tl.exp2(s), 0.0), axis=1)
    tl.store(partial_ptr + split * B + b, total, mask=b < B)


@triton.autotune(configs=_GRAD_FEATURES_CONFIGS, key=_KEY)
@triton.jit
def _grad_features_kernel(x_ptr, w_ptr, rows_ptr, inv_norm_ptr, coef_ptr, shift_ptr, partial_ptr, B, D, count,
                          offset, stride_x, stride_w, weight_scale, batch_bucket, rows_bucket, HAS_ROWS: tl.constexpr,
                          DOT: tl.constexpr, SPLITS: tl.constexpr, BLOCK_B: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_b, split = tl.program_id(0), tl.program_id(1)
    b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    d = tl.arange(0, BLOCK_D)
    in_batch = b < B
    x = tl.load(x_ptr + b[:, None] * stride_x + d[None, :], mask=in_batch[:, None] & (d[None, :] < D), other=0.0)
    coef = tl.load(coef_ptr + b, mask=in_batch, other=0.0)
    shift = tl.load(shift_ptr + b, mask=in_batch, other=0.0)
    grad = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    for tile in range(split, tl.cdiv(count, BLOCK_N), SPLITS):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        w_hat, in_range = _load_rows(w_ptr, rows_ptr, inv_norm_ptr, pos, offset, count, stride_w, D, HAS_ROWS,
                                     BLOCK_D)
        s = _dot(x, tl.trans((w_hat * weight_scale).to(x.dtype)), DOT)
        p = tl.where(in_range[None, :], coef[:, None] * tl.exp2(s - shift[:, None]), 0.0)
        grad += _dot(p.to(x.dtype), w_hat.to(x.dtype), DOT)
    out = partial_ptr + split * B * BLOCK_D + b[:, None] * BLOCK_D + d[None, :]
    tl.store(out, grad, mask=in_batch[:, None])


@triton.autotune(configs=_GRAD_ROWS_CONFIGS, key=_KEY)
@triton.jit
def _grad_rows_kernel(x_ptr, w_ptr, rows_ptr, inv_norm_ptr, coef_ptr, shift_ptr, out_ptr, B, D, start, end, offset,
                      stride_x, stride_w, stride_out, weight_scale, grad_scale, batch_bucket, rows_bucket,
                      HAS_ROWS: tl.constexpr,
                      DOT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    pos = start + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    w_hat, in_range = _load_rows(w_ptr, rows_ptr, inv_norm_ptr, pos, offset, end, stride_w, D, HAS_ROWS, BLOCK_D)
    operand = (w_hat * weight_scale).to(x_ptr.dtype.element_ty)
    grad = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for first in range(0, B, BLOCK_B):
        b = first + tl.arange(0, BLOCK_B)
        in_batch = b < B
        x = tl.load(x_ptr + b[:, None] * stride_x + d[None, :], mask=in_batch[:, None] & (d[None, :] < D),
                    other=0.0)
        coef = tl.load(coef_ptr + b, mask=in_batch, other=0.0)
        shift = tl.load(shift_ptr + b, mask=in_batch, other=0.0)
        s = _dot(x, tl.trans(operand), DOT)
        p = coef[:, None] * tl.exp2(s - shift[:, None])  # 0 for padding features (coef 0)
        grad += _dot(tl.trans(p.to(x.dtype)), x, DOT)
    # Backward of w / |w|: remove the radial component, divide by the norm (and the logits' scale).
    inv_norm = tl.load(inv_norm_ptr + pos, mask=in_range, other=0.0)
    radial = tl.sum(grad * w_hat, axis=1)
    grad = (grad - radial[:, None] * w_hat) * (inv_norm * grad_scale)[:, None]
    tl.store(out_ptr + (pos - start)[:, None].to(tl.int64) * stride_out + d[None, :], grad,
             mask=in_range[:, None] & (d[None, :] < D))


def _dot_mode(features: torch.Tensor) -> int:
    if features.dtype == torch.float32:
        return FP32
    return HALF_VALUES_IN_FP32 if INTERPRETED else HALF


def block_d(dim: int) -> int:
    """The feature dimension rounded up to a power of two (Triton's tiles), at least 16 (``tl.dot``)."""
    return max(16, triton.next_power_of_2(dim))


def splits_for(batch: int, features: torch.Tensor) -> int:
    """How many ways the row tiles are split so that the forward and feature-gradient kernels run
    enough programs: about 4 per multiprocessor."""
    if INTERPRETED or features.device.type != "cuda":
        return 2
    blocks = triton.cdiv(batch, 128)  # feature blocks of the larger candidate tiles
    processors = torch.cuda.get_device_properties(features.device).multi_processor_count
    return max(1, min(64, triton.cdiv(4 * processors, blocks)))


def _launch(kernel, grid, *args, **kwargs) -> None:
    """Launch an autotuned kernel; under ``parallel.deterministic`` (torch's deterministic algorithms)
    or without ``AUTOTUNE``, with its first config instead: the tile sizes set the order of the sums,
    and a timing-based choice could differ between a run and its resume."""
    if INTERPRETED or (AUTOTUNE and not torch.are_deterministic_algorithms_enabled()):
        kernel[grid](*args, **kwargs)
        return
    config = kernel.configs[0]
    meta = {**kwargs, **config.kwargs}
    kernel.fn[grid(meta) if callable(grid) else grid](*args, num_warps=config.num_warps,
                                                       num_stages=config.num_stages, **meta)


def _buckets(batch: int, rows: int, rows_key: int) -> tuple[int, int]:
    """The autotuner's size keys: powers of two at or above the batch and the rows, or the caller's
    ``rows_key`` when it gives one."""
    return triton.next_power_of_2(batch), rows_key or triton.next_power_of_2(max(rows, 1))


def _feature_blocks(batch: int, splits: int):
    return lambda meta: (triton.cdiv(batch, meta["BLOCK_B"]), splits)


def _row_args(rows: torch.Tensor | None, inv_norm: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return (rows if rows is not None else inv_norm), rows is not None  # any pointer when unused


def sum_exp(features, weight, rows, offset: int, count: int, inv_norm, weight_scale: float, partial,
            rows_key: int = 0) -> None:
    """``partial[s, b]``: split ``s``'s share of ``sum_j exp2(s_bj)``."""
    batch, dim = features.shape
    splits = partial.shape[0]
    rows_ptr, has_rows = _row_args(rows, inv_norm)
    _launch(_sum_exp_kernel, _feature_blocks(batch, splits), features, weight, rows_ptr, inv_norm, partial, batch,
            dim, count, offset, features.stride(0), weight.stride(0), weight_scale, *_buckets(batch, count, rows_key),
            HAS_ROWS=has_rows, DOT=_dot_mode(features), SPLITS=splits, BLOCK_D=block_d(dim))


def grad_features(features, weight, rows, offset: int, count: int, inv_norm, weight_scale: float, coef, shift,
                  partial, rows_key: int = 0) -> None:
    """``partial[s, b, :]``: split ``s``'s share of ``sum_j coef_b exp2(s_bj - shift_b) w_hat_j``."""
    batch, dim = features.shape
    splits = partial.shape[0]
    rows_ptr, has_rows = _row_args(rows, inv_norm)
    _launch(_grad_features_kernel, _feature_blocks(batch, splits), features, weight, rows_ptr, inv_norm, coef,
            shift, partial, batch, dim, count, offset, features.stride(0), weight.stride(0), weight_scale,
            *_buckets(batch, count, rows_key), HAS_ROWS=has_rows, DOT=_dot_mode(features), SPLITS=splits,
            BLOCK_D=block_d(dim))


def grad_rows(features, weight, rows, offset: int, start: int, end: int, inv_norm, weight_scale: float, coef, shift,
              grad_scale: float, out, rows_key: int = 0) -> None:
    """``out[i]``: the gradient of the unnormalised row at scored position ``start + i`` (softmax part)."""
    batch, dim = features.shape
    rows_ptr, has_rows = _row_args(rows, inv_norm)
    grid = lambda meta: (triton.cdiv(end - start, meta["BLOCK_N"]),)  # noqa: E731
    _launch(_grad_rows_kernel, grid, features, weight, rows_ptr, inv_norm, coef, shift, out, batch, dim, start, end,
            offset, features.stride(0), weight.stride(0), out.stride(0), weight_scale, grad_scale,
            *_buckets(batch, end - start, rows_key), HAS_ROWS=has_rows, DOT=_dot_mode(features), BLOCK_D=block_d(dim))
