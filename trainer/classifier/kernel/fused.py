"""The fused path of the sharded cosine-softmax loss: the same function as ``chunked``, with the
logits kept in the kernels' registers (``fused_triton``) instead of a ``[chunk, B]`` workspace.

What stays in PyTorch is O(B (K+1) D): the norms of the scored rows (one read of them), the K+1
target logits per sample (a gather of the target rows), their share of the gradients, the two
all-reduces, the loss forms (``losses``) and a positive logit that is no row (``positive_logit``), all
shared with the chunked path.  What the kernels do is the O(B N D) part: the sum of exponentials in
the forward, and in the backward the softmax part of ``dL/dz = coef_i exp(z_ij - log_normalizer_i) -
target_grad_ik`` pushed into the features and (unless they need no gradient) the rows.  A negative
``coef`` (a loss backpropagated with a negative weight) or a zero one (padding) needs no special
case here: it multiplies the tile in registers.

The chunked path remains the CPU path, the reference, and the path of kernels that carry a term
(CO2 reads every logit in its own pass; ``KernelSettings.implementation`` says which runs).
"""

from __future__ import annotations

import torch

from trainer.classifier.kernel import fused_ops  # noqa: F401  (registers the instcls:: ops)
from trainer.classifier.kernel.base2_logits import LOG2_E, scales
from trainer.classifier.kernel.chunk_workspace import NORM_EPS
from trainer.classifier.kernel.losses import LOG_NORMALIZER, LOSS_FORMS, SmoothingForm, Targets
from trainer.classifier.kernel.positive_logit import PositiveLogit
from trainer.classifier.kernel.reductions import SampleColumns, reduce_over_ranks
from trainer.classifier.kernel.row_adds import add_rows
from trainer.classifier.kernel.scored_rows import ScoredRows

TARGET_COLUMNS_PER_PASS = 8  # target columns gathered at once: [B, 8, D] fp32 is 32 MiB at B=8192, D=128
FUSED_SPLITS_ON_FAKE_DEVICES = 8  # the dry run's stand-in for splits_for (a GPU's order of magnitude)


def fused_splits(batch: int, features: torch.Tensor) -> int:
    """Ways the forward and feature-gradient kernels split the row tiles (partial sums [S, B(, D)])."""
    if features.device.type == "cuda" and not isinstance(features, torch._subclasses.FakeTensor):
        from trainer.classifier.kernel.fused_triton import splits_for

        return splits_for(batch, features)
    return FUSED_SPLITS_ON_FAKE_DEVICES if features.device.type == "cuda" else 2


def padded_dim(dim: int) -> int:
    """D rounded up to the kernels' tile width (``fused_triton.block_d``, which needs Triton): the partial feature
    gradients are written at that width."""
    return max(16, 1 << (dim - 1).bit_length())


def autotune_rows_key(rows: int, rows_bound: int | None = None) -> int:
    """The rows part of the fused kernels' autotune key: the power of two at or above ``rows``, or
    at or above ``rows_bound`` when one is given (``KernelSettings.rows_bound``), so that row counts
    which change by step and by rank all share one key, tuned once."""
    return 1 << (max(rows, rows_bound or 0, 1) - 1).bit_length()


class _Rows:
    """The scored rows as the kernels take them, with ``1/|w|`` of each (the kernels normalise in
    registers; the norms cost one read of the rows)."""

    def __init__(self, weight: torch.Tensor, scored: ScoredRows, rows_bound: int | None) -> None:
        self.scored, self.rows_bound = scored, rows_bound
        # The kernels read rows through raw pointers: the index vector must be dense (a [::2] view is not)
        self.indices = None if scored.indices is None else scored.indices.contiguous()
        self.offset, self.count = scored.offset, scored.count
        selected = weight[scored.offset: scored.offset + scored.count] if scored.indices is None else \
            weight.index_select(0, scored.indices)
        self.inv_norm = torch.linalg.vector_norm(selected.float(), dim=1).clamp_min_(NORM_EPS).reciprocal_()

    def local_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Rows of W at scored ``positions`` (any shape; each must be a valid position)."""
        return positions + self.offset if self.indices is None else self.indices[positions]

    def hat(self, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 ``w / |w|`` at ``positions`` ([..., D])."""
        return weight[self.local_rows(positions)].float() * self.inv_norm[positions][..., None]


def _target_passes(target_cols: torch.Tensor):
    """``(columns slice, safe positions, owned)`` of the target columns, a few at a time."""
    for first in range(0, target_cols.shape[1], TARGET_COLUMNS_PER_PASS):
        cols = target_cols[:, first: first + TARGET_COLUMNS_PER_PASS]
        owned = cols >= 0
        yield slice(first, first + cols.shape[1]), torch.where(owned, cols, 0), owned


def _target_logits_base2(features, weight, rows: _Rows, target_cols, weight_scale: float) -> torch.Tensor:
    """``[B, K+1]`` base-2 logits of the owned targets (0 elsewhere), from the operands the kernels
    use: the row normalised and scaled in fp32 and rounded to the features' dtype."""
    out = torch.zeros(target_cols.shape, device=features.device)
    x = features.float()
    for columns, positions, owned in _target_passes(target_cols):
        operand = (rows.hat(weight, positions) * weight_scale).to(features.dtype).float()
        out[:, columns] = torch.where(owned, torch.einsum("bkd,bd->bk", operand, x), 0.0)
    return out


class FusedShardedCosineCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, weight, target_cols, target_weights, settings, group, timer, scored: ScoredRows,
                update_in_backward, positive_logits=None):
        feature_scale, weight_scale = scales(settings.temperature, features.dtype)
        scaled = (features * feature_scale if feature_scale != 1.0 else features).contiguous()
        weight = weight.detach()
        if weight.stride(1) != 1:
            raise ValueError("the fused kernels read W's rows as contiguous vectors: W must have stride 1 in D")
        rows = _Rows(weight, scored, settings.rows_bound if settings.rows_vary else None)
        batch = scaled.shape[0]
        partial = torch.empty(fused_splits(batch, scaled), batch, device=scaled.device)
        torch.ops.instcls.cosine_sum_exp(scaled, weight, rows.indices, rows.offset, rows.count, rows.inv_norm,
                                         weight_scale, partial, autotune_rows_key(rows.count, rows.rows_bound))
        sum_exp = partial.sum(dim=0)
        target_logits = _target_logits_base2(scaled, weight, rows, target_cols, weight_scale) / LOG2_E
        targets = Targets(target_logits, target_cols >= 0, target_weights.float())
        positive = None if positive_logits is None else PositiveLogit(positive_logits, group)
        if positive is not None:
            sum_exp, targets = positive.add_to_sum_exp(sum_exp), positive.with_row_targets(targets)
        form = LOSS_FORMS[SmoothingForm(settings.form)]
        columns = SampleColumns(logsumexp={LOG_NORMALIZER: torch.log(sum_exp)}).add(form.local_columns(targets))
        loss, gradient = form.finish(targets, reduce_over_ranks(columns, group, timer))
        positive_coef = None
        if positive is not None:
            gradient, positive_coef = positive.split(gradient)
        ctx.save_for_backward(scaled, weight, target_cols, rows.inv_norm, gradient.softmax_scale,
                              gradient.log_normalizer, gradient.target_coef, positive_coef)
        ctx.positive_dtype = None if positive_logits is None else positive_logits.dtype
        ctx.settings, ctx.rows, ctx.update, ctx.scales = settings, rows, update_in_backward, (feature_scale,
                                                                                              weight_scale)
        ctx.features_dtype = features.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        scaled, weight, target_cols, inv_norm, softmax_scale, log_normalizer, target_coef, positive_coef = \
            ctx.saved_tensors
        rows: _Rows = ctx.rows
        rows.inv_norm = inv_norm
        settings, (feature_scale, weight_scale) = ctx.settings, ctx.scales
        grad_loss = grad_loss.float()
        coef = (grad_loss * softmax_scale).contiguous()
        shift = (log_normalizer * LOG2_E).contiguous()
        target_grad = grad_loss[:, None] * target_coef  # subtracted at the targets' rows
        grad_features = _softmax_grad_features(scaled, weight, rows, coef, shift, weight_scale)
        # Rows that need no gradient (a queue of keys) get none: no weight-gradient kernel.
        grad_weight = None
        if ctx.update is not None or ctx.needs_input_grad[1]:
            grad_weight = _grad_weight(scaled, weight, rows, target_cols, target_grad, coef, shift, settings,
                                       feature_scale, weight_scale, ctx.update)
        _subtract_targets(scaled, weight, rows, target_cols, target_grad, feature_scale, settings.temperature,
                          grad_features, grad_weight)
        grad_features = grad_features.mul_(1.0 / settings.temperature).to(ctx.features_dtype)
        grad_positive = None if positive_coef is None else (grad_loss * positive_coef).to(ctx.positive_dtype)
        return grad_features, grad_weight, None, None, None, None, None, None, None, grad_positive


def _softmax_grad_features(scaled, weight, rows: _Rows, coef, shift, weight_scale: float):
    """fp32 ``sum_j coef_i exp(z_ij - log_normalizer_i) w_hat_j`` ([B, D]; the caller divides by tau)."""
    batch, dim = scaled.shape
    partial = torch.empty(fused_splits(batch, scaled), batch, padded_dim(dim), device=scaled.device)
    torch.ops.instcls.cosine_grad_features(scaled, weight, rows.indices, rows.offset, rows.count, rows.inv_norm,
                                           weight_scale, coef, shift, partial,
                                           autotune_rows_key(rows.count, rows.rows_bound))
    return partial[:, :, :dim].sum(dim=0)


def _target_row_grads(x, hat, inv_norm, values, temperature: float):
    """``[B, k, D]``: ``-values`` times the gradient of each target logit w.r.t. its unnormalised row,
    ``(x - <x, w_hat> w_hat) / (|w| tau)``; ``x`` ``[B, 1, D]`` the features the logits were computed
    from, ``hat`` and ``inv_norm`` the target rows' ``w / |w|`` and ``1 / |w|``."""
    radial = (hat * x).sum(dim=2, keepdim=True)
    return -(values * inv_norm / temperature)[..., None] * (x - radial * hat)


def _subtract_targets(scaled, weight, rows: _Rows, target_cols, target_grad, feature_scale: float,
                      temperature: float, grad_features, grad_weight) -> None:
    """The targets' share of ``dL/dz`` (``-target_grad`` at their rows), pushed into the features'
    gradient (before its 1/tau) and, when it exists, W's: one gather of each column group's rows."""
    x = scaled.float()[:, None, :] / feature_scale
    for columns, positions, owned in _target_passes(target_cols):
        values = torch.where(owned, target_grad[:, columns], 0.0)
        hat = rows.hat(weight, positions)
        grad_features -= torch.einsum("bk,bkd->bd", values, hat)
        if grad_weight is not None:
            grads = _target_row_grads(x, hat, rows.inv_norm[positions], values, temperature)
            add_rows(grad_weight, rows.local_rows(positions).reshape(-1), grads.reshape(-1, grads.shape[-1]))
            del grads  # else it lives on beside the next group's temporaries: a fourth [B, 8, D] at the peak


def _grad_weight(scaled, weight, rows: _Rows, target_cols, target_grad, coef, shift, settings, feature_scale: float,
                 weight_scale: float, update):
    """W's gradient from the softmax part (the targets' share follows in ``_subtract_targets``), or None
    when ``update`` applies it chunk by chunk during the backward, the targets' share included."""
    scored: ScoredRows = rows.scored
    grad_scale = 1.0 / (feature_scale * settings.temperature)
    grad_weight = None if update is not None else scored.gradient_for(weight)
    buffer = None
    chunk_bound = None if rows.rows_bound is None else min(settings.chunk_size, rows.rows_bound)
    for start, end in scored.chunks(settings.chunk_size):
        direct = update is None and scored.indices is None
        if direct:  # a window's rows are written in place by the kernel
            out = grad_weight[scored.offset + start: scored.offset + end]
        else:
            if buffer is None:
                buffer = torch.empty(min(settings.chunk_size, scored.count) + 1, weight.shape[1],
                                     device=weight.device)
            out = buffer[: end - start]
        torch.ops.instcls.cosine_grad_rows(scaled, weight, rows.indices, rows.offset, start, end, rows.inv_norm,
                                           weight_scale, coef, shift, grad_scale, out,
                                           autotune_rows_key(end - start, chunk_bound))
        if update is not None:
            _add_targets_in_chunk(buffer, start, end, scaled, weight, rows, target_cols, target_grad,
                                  feature_scale, settings.temperature)
            update.apply_rows(scored.rows_of(start, end), out)  # later chunks never read these rows
        elif not direct:
            add_rows(grad_weight, scored.rows_of(start, end), out)  # a row sampled twice gets both
    return grad_weight


def _add_targets_in_chunk(buffer, start: int, end: int, scaled, weight, rows: _Rows, target_cols, target_grad,
                          feature_scale: float, temperature: float) -> None:
    """The target rows' share of a chunk's gradient, before the in-backward update applies it.  Targets
    outside ``[start, end)`` land in the buffer's spare last row (no data-dependent selection: no sync)."""
    sink = buffer.shape[0] - 1
    x = scaled.float()[:, None, :] / feature_scale
    for columns, positions, owned in _target_passes(target_cols):
        inside = owned & (positions >= start) & (positions < end)
        values = torch.where(inside, target_grad[:, columns], 0.0)
        grads = _target_row_grads(x, rows.hat(weight, positions), rows.inv_norm[positions], values, temperature)
        slots = torch.where(inside, positions - start, sink)
        add_rows(buffer, slots.reshape(-1), grads.reshape(-1, grads.shape[-1]))
        del grads  # not held beside the next column group's temporaries
