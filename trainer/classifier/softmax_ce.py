"""Cosine-softmax cross entropy over a class-sharded weight matrix, computed in class chunks.

Every rank of a classifier group holds the gathered, L2-normalised features ``x`` of the whole
group batch ``[B, D]`` and its own weight shard ``W_r [N_local, D]``.  The logits of sample i and
class j are ``z_ij = <x_i, w_j / |w_j|> / tau``.  Targets are given per sample as K+1 class ids
(the instance, then K hard negatives) with weights ``y`` (``1 - alpha`` and ``alpha / K``).

Two loss forms (``SmoothingForm``):

* ``paper`` — Eq. 3 of the paper, the weights sit *inside* the log:
  ``L_i = -log( sum_j y_ij exp(z_ij) / sum_j exp(z_ij) )``.
* ``soft_target`` — the usual label-smoothed cross entropy, weights *outside* the log:
  ``L_i = -sum_j y_ij log softmax(z_i)_j``.

With ``alpha = 0`` (one target of weight 1) both are ``F.cross_entropy``.

Communication is exactly two all-reduces of ``[B, 2]`` fp32 tensors per forward and none in
backward: a MAX (row max of the logits, and of the target logits used as the stabiliser of the
paper form) and a SUM (the sum of exponentials, fused with the target term).  Logits are never
held for more than ``chunk_size`` classes at a time: the forward keeps an online max / sum-exp, the
backward recomputes each chunk, so activation memory is O(B * chunk_size) rather than O(B * N_local).
Matmuls run in the dtype of ``x`` (bf16/fp16 allowed); max, sum-exp, loss and gradients of the
fp32 weight are accumulated in fp32.
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.distributed as dist

from trainer.parallel.collectives import CommTimer, Group, all_reduce_

NORM_EPS = 1e-12  # the epsilon of torch.nn.functional.normalize


class SmoothingForm(str, Enum):
    PAPER = "paper"
    SOFT_TARGET = "soft_target"


class ChunkWorkspace:
    """Buffers for one chunk, allocated once per forward/backward and reused by every chunk.

    Allocating fresh ``[B, chunk]`` and ``[chunk, D]`` tensors per chunk costs ~45% of a CPU step:
    glibc returns large blocks to the OS on free, so every chunk page-faults its memory anew.
    On GPUs the caching allocator already reuses blocks; the workspace costs nothing there.
    """

    def __init__(self, batch: int, chunk_rows: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self._logits = torch.empty(batch * chunk_rows, device=device)
        # Half-precision matmuls write their own dtype first; fp32 ones write the logits directly.
        self._matmul_out = None if dtype == torch.float32 else torch.empty(batch * chunk_rows, dtype=dtype, device=device)
        self._weight_hat = torch.empty(chunk_rows * dim, device=device)
        self._weight_norm = torch.empty(chunk_rows, device=device)
        self._grad_weight_hat = torch.empty(chunk_rows * dim, device=device)

    def normalized_rows(self, weight_chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w / |w|, |w|)`` per row in fp32, the norm clamped like ``F.normalize``."""
        rows, dim = weight_chunk.shape
        norm = torch.linalg.vector_norm(weight_chunk, dim=1, out=self._weight_norm[:rows]).clamp_min_(NORM_EPS)[:, None]
        weight_hat = torch.div(weight_chunk, norm, out=self._weight_hat[: rows * dim].view(rows, dim))
        return weight_hat, norm

    def cosine_logits(self, features: torch.Tensor, weight_hat: torch.Tensor, temperature: float) -> torch.Tensor:
        """fp32 ``[B, rows]`` logits; the matmul runs in the features' dtype."""
        batch, rows = features.shape[0], weight_hat.shape[0]
        logits = self._logits[: batch * rows].view(batch, rows)
        if self._matmul_out is None:
            torch.mm(features, weight_hat.t(), out=logits)
        else:
            low = self._matmul_out[: batch * rows].view(batch, rows)
            logits.copy_(torch.mm(features, weight_hat.to(features.dtype).t(), out=low))
        return logits.div_(temperature)

    def grad_weight_hat(self, grad_logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fp32 ``[rows, D]`` gradient w.r.t. the normalised weight rows of the chunk."""
        rows, dim = grad_logits.shape[1], features.shape[1]
        out = self._grad_weight_hat[: rows * dim].view(rows, dim)
        if self._matmul_out is None:
            return torch.mm(grad_logits.t(), features, out=out)
        return out.copy_(grad_logits.to(features.dtype).t() @ features)


def _column_in_chunk(target_cols: torch.Tensor, chunk_start: int, chunk_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Clamp-safe column of each target inside the chunk, and whether it lies in the chunk."""
    cols = target_cols - chunk_start
    inside = (cols >= 0) & (cols < chunk_len)
    return cols.clamp(0, chunk_len - 1), inside


def _chunks(num_rows: int, chunk_size: int):
    for start in range(0, num_rows, chunk_size):
        yield start, min(start + chunk_size, num_rows)


class ShardedCosineSoftmaxCE(torch.autograd.Function):
    """Forward: per-sample loss ``[B]`` (identical on every rank of ``group``).
    Backward: gradients w.r.t. this rank's gathered features (its shard's contribution only; the
    caller's all-gather backward sums them over the group) and w.r.t. the local weight shard."""

    @staticmethod
    def forward(
        ctx,
        features: torch.Tensor,  # [B, D] normalised, any float dtype
        weight: torch.Tensor,  # [N_local, D] fp32 shard
        target_cols: torch.Tensor,  # [B, K+1] local row of each target, -1 if owned elsewhere
        target_weights: torch.Tensor,  # [B, K+1] fp32 y values
        temperature: float,
        chunk_size: int,
        form: SmoothingForm,
        group: Group,
        timer: CommTimer | None = None,
        update_in_backward=None,  # an InBackwardSGD: apply each chunk's gradient at once
    ) -> torch.Tensor:
        batch = features.shape[0]
        device = features.device
        row_max = torch.full((batch,), float("-inf"), device=device)
        sum_exp = torch.zeros(batch, device=device)
        target_logits = torch.zeros(target_cols.shape, device=device)
        workspace = ChunkWorkspace(batch, min(chunk_size, weight.shape[0]), weight.shape[1], features.dtype, device)
        for start, end in _chunks(weight.shape[0], chunk_size):
            weight_hat, _ = workspace.normalized_rows(weight[start:end])
            logits = workspace.cosine_logits(features, weight_hat, temperature)
            cols, inside = _column_in_chunk(target_cols, start, end - start)
            target_logits += torch.where(inside, logits.gather(1, cols), 0.0)
            new_max = torch.maximum(row_max, logits.amax(dim=1))
            # In place: the chunk's logits are not needed once exponentiated.
            chunk_sum_exp = logits.sub_(new_max[:, None]).exp_().sum(dim=1)
            sum_exp = sum_exp * torch.exp(row_max - new_max) + chunk_sum_exp
            row_max = new_max

        owned = target_cols >= 0
        active = owned & (target_weights > 0)
        target_max = torch.where(active, target_logits, float("-inf")).amax(dim=1)
        maxes = all_reduce_(torch.stack([row_max, target_max], dim=1), dist.ReduceOp.MAX, group, timer)
        global_max, global_target_max = maxes.unbind(dim=1)
        sum_exp = sum_exp * torch.exp(row_max - global_max)

        if form is SmoothingForm.PAPER:
            target_exp = torch.where(active, target_weights * torch.exp(target_logits - global_target_max[:, None]), 0.0)
            target_term = target_exp.sum(dim=1)
        else:
            target_term = torch.where(owned, target_weights * target_logits, 0.0).sum(dim=1)
        sums = all_reduce_(torch.stack([sum_exp, target_term], dim=1), dist.ReduceOp.SUM, group, timer)
        global_sum_exp, global_target_term = sums.unbind(dim=1)
        log_normalizer = global_max + torch.log(global_sum_exp)

        if form is SmoothingForm.PAPER:
            loss = log_normalizer - (global_target_max + torch.log(global_target_term))
            # dL/dz_ij = p_ij - q_ij, q = y·exp(z) renormalised over the targets.
            target_coef = target_exp / global_target_term[:, None]
            softmax_scale = torch.ones(batch, device=device)
        else:
            weight_total = target_weights.sum(dim=1)
            loss = weight_total * log_normalizer - global_target_term
            # dL/dz_ij = (sum_k y_ik) p_ij - y_ij.
            target_coef = torch.where(owned, target_weights, 0.0)
            softmax_scale = weight_total

        ctx.save_for_backward(features, weight, target_cols, target_coef, log_normalizer, softmax_scale)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.update_in_backward = update_in_backward
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        features, weight, target_cols, target_coef, log_normalizer, softmax_scale = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad_loss = grad_loss.float()
        softmax_grad = (grad_loss * softmax_scale)[:, None]
        target_grad = grad_loss[:, None] * target_coef
        update = ctx.update_in_backward
        grad_features = torch.zeros(features.shape, dtype=torch.float32, device=features.device)
        grad_weight = None if update is not None else torch.empty_like(weight, dtype=torch.float32)
        workspace = ChunkWorkspace(
            features.shape[0], min(chunk_size, weight.shape[0]), weight.shape[1], features.dtype, features.device
        )
        for start, end in _chunks(weight.shape[0], chunk_size):
            weight_hat, weight_norm = workspace.normalized_rows(weight[start:end])
            logits = workspace.cosine_logits(features, weight_hat, temperature)
            grad_logits = logits.sub_(log_normalizer[:, None]).exp_().mul_(softmax_grad)  # in place
            cols, inside = _column_in_chunk(target_cols, start, end - start)
            grad_logits.scatter_add_(1, cols, torch.where(inside, -target_grad, 0.0))
            grad_logits.div_(temperature)
            grad_features += (grad_logits.to(features.dtype) @ weight_hat.to(features.dtype)).float()
            grad_weight_hat = workspace.grad_weight_hat(grad_logits, features)
            # Backward of w / |w|: remove the radial component, divide by the norm.
            radial = torch.bmm(grad_weight_hat[:, None, :], weight_hat[:, :, None])[:, 0]  # row dots, no [rows, D] temp
            grad_rows = grad_weight_hat.addcmul_(weight_hat, radial, value=-1).div_(weight_norm)
            if update is not None:
                update.apply_rows(start, end, grad_rows)  # later chunks never read these rows again
            else:
                grad_weight[start:end] = grad_rows
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_features.to(features.dtype), grad_weight, None, None, None, None, None, None, None, None
