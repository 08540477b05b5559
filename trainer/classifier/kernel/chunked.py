"""Cosine-softmax cross entropy over a class-sharded weight matrix, computed in class chunks.

Every rank of a classifier group holds the gathered, L2-normalised features ``x`` of the whole
group batch ``[B, D]`` and its own weight shard ``W_r [N_local, D]``.  The logits of sample i and
row j are ``z_ij = <x_i, w_j / |w_j|> / tau``.  The kernel scores any subset of the local rows (all
of them, a window, or sampled rows; see ``ScoredRows``), ``chunk_size`` rows at a time, so the
logits never exist for more than one chunk unless the logits cache holds them.

Per sample the forward keeps only ``sum_j exp(z_ij)`` and the logits of the K+1 targets; the loss
form (``trainer.classifier.kernel.losses``) turns them into the loss after one MAX and one SUM all-reduce
(``trainer.classifier.kernel.reductions``), and hands back the coefficients of ``dL/dz``, which the
backward applies chunk by chunk.  The backward recomputes each chunk's logits (4 matmuls per step
for 3 useful ones) unless ``logits_cache_bytes`` can hold ``exp(z)`` for all scored rows (the
logits themselves when a term runs).

A ``ChunkTerm`` (``trainer.classifier.terms.chunk_term``) may ride along: it reads every chunk's logits
in the same pass, adds its per-sample columns to the same two all-reduces and writes its share of
each chunk's ``dL/dz``; the kernel does not know which term it runs.

MoCo scores a queue of keys as the rows: a per-sample positive logit that is no row
(``positive_logits``, see ``trainer.classifier.kernel.positive_logit``) joins the softmax, and rows
that do not require grad (the queue is not trained) cost no weight-gradient matmul in the backward.

No running max: features and rows are unit vectors, so ``|z| <= 1/tau``, and for
``1/tau <= MAX_ABS_LOGIT`` every ``exp(z)`` and every sum of them is a normal fp32 number.  That
saves the max pass and the rescaling of every chunk.  The matmuls produce base-2 logits
``z * log2(e)`` (the constant and ``1/tau`` are folded into the features once) because ``exp2`` is
~3x faster than ``exp`` on CPUs and ``exp2(z log2 e) = exp(z)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from trainer.classifier.kernel.base2_logits import LOG2_E, scales
from trainer.classifier.kernel.chunk_workspace import ChunkWorkspace, LogitsCache
from trainer.classifier.kernel.losses import LOG_NORMALIZER, LOSS_FORMS, SmoothingForm, Targets
from trainer.classifier.kernel.positive_logit import PositiveLogit
from trainer.classifier.kernel.reductions import SampleColumns, reduce_over_ranks
from trainer.classifier.kernel.row_adds import add_into_rows, add_rows
from trainer.classifier.kernel.scored_rows import ScoredRows
from trainer.classifier.terms.chunk_term import ChunkTerm, KernelPass
from trainer.parallel.collectives import CommTimer, Group, group_size

IMPLEMENTATIONS = ("auto", "chunked", "fused")
MAX_ABS_LOGIT = 50.0  # exp(+-50) and N * exp(50) stay far inside fp32's normal range


@dataclass(frozen=True)
class KernelSettings:
    temperature: float = 0.15
    chunk_size: int = 65536
    form: str = "paper"  # "paper" | "soft_target"  (SmoothingForm values)
    logits_cache_bytes: int = 0  # 0: recompute in backward
    # The weight's rows are sampled afresh each step (PIC's working rows), so the number of rows
    # changes from step to step: a fused term pads its chunks to a few sizes rather than recompile.
    rows_vary: bool = False
    # With rows_vary: the most rows any rank of the group scores in any step.  The fused kernels'
    # autotune key is taken from it rather than from the step's rows, so every step on every rank
    # uses the config tuned at the first step (a new key re-tunes for seconds on the one rank that
    # meets it, while the others wait in the next collective).
    rows_bound: int | None = None
    # "auto": the fused Triton kernels (``fused``) for CUDA tensors without a term, the chunked
    # loop otherwise; "chunked" or "fused" force one (fused on CPU tensors needs TRITON_INTERPRET=1).
    implementation: str = "auto"

    def __post_init__(self) -> None:
        if not 1.0 / MAX_ABS_LOGIT <= self.temperature:
            raise ValueError(f"temperature={self.temperature}: the kernel needs tau >= {1 / MAX_ABS_LOGIT} "
                             f"(cosine logits up to 1/tau are exponentiated without a running max)")
        if self.rows_bound is not None and self.rows_bound < 1:
            raise ValueError(f"rows_bound={self.rows_bound} must be >= 1 (the most rows a rank scores) or None")
        if self.chunk_size < 1 or self.logits_cache_bytes < 0:
            raise ValueError(f"chunk_size={self.chunk_size} must be >= 1, logits_cache_bytes="
                             f"{self.logits_cache_bytes} >= 0")
        SmoothingForm(self.form)  # raises on an unknown form
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation={self.implementation!r}: choose one of {IMPLEMENTATIONS}")

    def resolved_implementation(self, device: torch.device, has_term: bool) -> str:
        """Which path runs for tensors on ``device``: fused on CUDA unless a term rides along."""
        if self.implementation == "fused" and has_term:
            raise ValueError("implementation=fused cannot carry a term (CO2): its term reads every logit in the "
                             "chunked loop; use implementation=auto or chunked")
        if self.implementation != "auto":
            return self.implementation
        return "fused" if device.type == "cuda" and not has_term else "chunked"


def sharded_cosine_ce(features, weight, target_cols, target_weights, settings: KernelSettings, group,
                      timer=None, rows=None, update_in_backward=None, positive_logits=None) -> torch.Tensor:
    """Per-sample loss ``[B]``, identical on every rank of ``group``.

    Args:
        features: ``[B, D]`` gathered, L2-normalised features (fp32/bf16/fp16).
        weight: ``[N_local, D]`` fp32 shard.  One that does not require grad (a queue of keys)
            costs no row gradient: the backward skips that matmul.
        target_cols: ``[B, K+1]`` int64 position of each target among the scored rows, -1 where
            another rank (or no scored row) holds it.  ``[B, K]`` with ``positive_logits`` (K may be 0).
        target_weights: ``[B, K+1]`` fp32 ``y`` (an expanded view is fine); with
            ``positive_logits`` the positive's weight comes first.
        rows: ``None`` (all local rows), ``slice(a, b)`` or an int64 tensor of local rows.
        update_in_backward: an ``InBackwardSGD`` that applies each chunk's gradient at once (then
            no gradient is returned for ``weight``); sampled rows must then be distinct.
        positive_logits: ``[B]`` natural-unit logits of a per-sample positive that is no row of
            ``weight`` (MoCo's ``<q, k+> / tau``), the same on every rank, with autograd: it joins
            the softmax's normaliser and is the first target (see ``positive_logit``).

    Backward: the gradient w.r.t. the features (and ``positive_logits``) is this rank's
    contribution only (the caller's all-gather backward sums it over the group); the weight's
    gradient touches the scored rows only.  A sample whose loss gradient is 0 (padding)
    contributes exactly 0 to both.
    """
    return _apply(features, weight, target_cols, target_weights, settings, group, timer, rows, update_in_backward,
                  None, positive_logits)[0]


def sharded_cosine_ce_with_term(features, weight, target_cols, target_weights, settings: KernelSettings,
                               term: ChunkTerm, group, timer=None, rows=None, update_in_backward=None,
                               positive_logits=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per-sample loss [B], per-sample term [B])`` from the same chunk loop and the same two
    all-reduces: ``term`` (a ``trainer.classifier.terms.chunk_term.ChunkTerm``) adds its columns to them.
    With ``positive_logits`` no column has an own row among the scored rows (the term excludes none)."""
    return _apply(features, weight, target_cols, target_weights, settings, group, timer, rows, update_in_backward,
                  term, positive_logits)


def _apply(features, weight, target_cols, target_weights, settings, group, timer, rows, update_in_backward, term,
           positive_logits):
    scored = ScoredRows(rows, weight.shape[0])
    _check_target_widths(target_cols, target_weights, positive_logits is not None)
    if settings.resolved_implementation(features.device, term is not None) == "fused":
        from trainer.classifier.kernel.fused import FusedShardedCosineCE

        loss = FusedShardedCosineCE.apply(features, weight, target_cols, target_weights, settings, group, timer,
                                          scored, update_in_backward, positive_logits)
        return loss, loss.new_zeros(0)
    # Without a backward to come (no_grad, frozen inputs) a cache would only cost memory.
    needs_grad = features.requires_grad or weight.requires_grad or (
        positive_logits is not None and positive_logits.requires_grad)
    backward_expected = torch.is_grad_enabled() and needs_grad
    cache_budget = settings.logits_cache_bytes if backward_expected else 0
    return _ShardedCosineCE.apply(features, weight, target_cols, target_weights, settings, group, timer, scored,
                                  update_in_backward, cache_budget, term, positive_logits)


def _check_target_widths(target_cols, target_weights, has_positive: bool) -> None:
    """One weight per target: ``K + 1`` of each, or ``K`` rows and ``1 + K`` weights with a positive."""
    expected = target_cols.shape[1] + has_positive
    if target_weights.shape[-1] != expected:
        what = f"{target_cols.shape[1]} target rows" + (" and the positive" if has_positive else "")
        raise ValueError(f"target_weights has {target_weights.shape[-1]} columns for {what}: give {expected}, "
                         + ("the positive's first" if has_positive else "one per target column"))


class _TargetsByChunk:
    """Where each target lies: its chunk and its row there, computed once per pass so that each
    chunk costs a comparison.  Laid out ``[K+1, B]``, like the ``[rows, B]`` chunk logits."""

    def __init__(self, target_cols: torch.Tensor, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        cols = target_cols.t()
        self.chunk = torch.where(cols >= 0, cols.div(chunk_size, rounding_mode="floor"), -1)
        self.row = cols.remainder(chunk_size)  # a valid index even where chunk == -1

    def in_chunk(self, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row, inside)``: a gather/scatter-safe row per target, and whether it is in the chunk."""
        inside = self.chunk == start // self.chunk_size
        return (self.row if rows == self.chunk_size else self.row.clamp(max=rows - 1)), inside


def _cache_for(cache_budget: int, batch: int, scored: ScoredRows, device) -> LogitsCache | None:
    if 0 < LogitsCache.size_bytes(batch, scored.count) <= cache_budget:
        return LogitsCache(batch, scored.count, device)
    return None


def _kernel_pass(batch: int, ranks: int, scored: ScoredRows, targets: _TargetsByChunk, settings: KernelSettings,
                 has_positive: bool = False) -> KernelPass:
    """What a term is told of the pass; the targets' row 0 is each column's own row, unless a positive
    logit is each column's own (then no column has one among the rows)."""
    if has_positive:
        own_chunk = torch.full((batch,), -1, dtype=torch.int64, device=targets.chunk.device)
        own_row = torch.zeros_like(own_chunk)
    else:
        own_chunk, own_row = targets.chunk[0], targets.row[0]
    return KernelPass(batch, ranks, settings.temperature, scored.num_chunks(settings.chunk_size), own_chunk, own_row,
                      rows_vary=settings.rows_vary or scored.indices is not None)


def _forward_chunks(scaled_features, weight, scored: ScoredRows, target_cols, settings: KernelSettings,
                    cache_budget: int, term: ChunkTerm | None, ranks: int, has_positive: bool = False):
    """``(sum_j exp(z_ij) [B], base-2 target logits [B, K+1], cache or None, the term's forward or None)``
    over the scored rows.  With a term the cache keeps the base-2 logits themselves (the term's
    backward needs them), otherwise ``exp(z)``."""
    batch, device = scaled_features.shape[0], scaled_features.device
    sum_exp = torch.zeros(batch, device=device)
    target_logits = torch.zeros(target_cols.shape[::-1], device=device)  # [K+1, B]
    cache = _cache_for(cache_budget, batch, scored, device)
    workspace = ChunkWorkspace(batch, min(settings.chunk_size, scored.count), weight.shape[1], scaled_features.dtype,
                               device, gathers_rows=scored.indices is not None,
                               weight_scale=scales(settings.temperature, scaled_features.dtype)[1])
    targets = _TargetsByChunk(target_cols, settings.chunk_size)
    term_pass = None if term is None else term.start_forward(
        _kernel_pass(batch, ranks, scored, targets, settings, has_positive))
    for start, end in scored.chunks(settings.chunk_size):
        weight_hat, _ = workspace.normalized_rows(scored.read(weight, start, end, workspace.gathered_rows))
        out = workspace.logits(end - start) if cache is None else cache.chunk(start, end)
        logits = workspace.cosine_logits(scaled_features, weight_hat, out)
        target_rows, inside = targets.in_chunk(start, end - start)
        target_logits += torch.where(inside, logits.gather(0, target_rows), 0.0)
        if term_pass is None:
            sum_exp += logits.exp2_().sum(dim=0)  # in place: the cache keeps exp(z)
        else:  # the logits stay (the cache keeps them for the term's backward)
            sum_exp = term_pass.add_chunk(sum_exp, logits, start // settings.chunk_size)
    return sum_exp, target_logits.t(), cache, term_pass


class _ShardedCosineCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, weight, target_cols, target_weights, settings: KernelSettings, group: Group,
                timer: CommTimer | None, scored: ScoredRows, update_in_backward, cache_budget: int,
                term: ChunkTerm | None, positive_logits: torch.Tensor | None):
        # log2(e)/tau is folded into fp32 features once instead of scaling every chunk's logits
        # (half-precision features stay as given, see scales).
        feature_scale = scales(settings.temperature, features.dtype)[0]
        scaled_features = features * feature_scale if feature_scale != 1.0 else features
        ranks = group_size(group)
        positive = None if positive_logits is None else PositiveLogit(positive_logits, group)
        sum_exp, target_logits_base2, cache, term_pass = _forward_chunks(
            scaled_features, weight, scored, target_cols, settings, cache_budget, term, ranks, positive is not None
        )
        targets = Targets(target_logits_base2 / LOG2_E, target_cols >= 0, target_weights.float())
        if positive is not None:
            sum_exp, targets = positive.add_to_sum_exp(sum_exp), positive.with_row_targets(targets)
        form = LOSS_FORMS[SmoothingForm(settings.form)]
        columns = SampleColumns(logsumexp={LOG_NORMALIZER: torch.log(sum_exp)}).add(form.local_columns(targets))
        if term_pass is not None:
            columns = columns.add(term_pass.columns())  # more columns, the same two all-reduces
        reduced = reduce_over_ranks(columns, group, timer)
        loss, gradient = form.finish(targets, reduced)
        positive_coef = None
        if positive is not None:
            gradient, positive_coef = positive.split(gradient)
        ctx.save_for_backward(scaled_features, weight, target_cols, gradient.softmax_scale, gradient.log_normalizer,
                              gradient.target_coef, positive_coef)
        ctx.settings, ctx.scored, ctx.cache, ctx.update_in_backward = settings, scored, cache, update_in_backward
        ctx.term, ctx.ranks, ctx.has_positive = term, ranks, positive is not None
        ctx.positive_dtype = None if positive_logits is None else positive_logits.dtype
        if term_pass is None:
            values = loss.new_zeros(0)
            ctx.mark_non_differentiable(values)
            ctx.term_saved = None
        else:
            values, ctx.term_saved = term_pass.finish(reduced)
        return loss, values

    @staticmethod
    def backward(ctx, grad_loss, grad_term):
        scaled_features, weight, target_cols, softmax_scale, log_normalizer, target_coef, positive_coef = \
            ctx.saved_tensors
        term_backward = None if ctx.term is None else partial(_start_term_backward, ctx, grad_term)
        grad_features, grad_weight = _backward_chunks(
            scaled_features, weight, target_cols, grad_loss.float() * softmax_scale, log_normalizer,
            grad_loss.float()[:, None] * target_coef, ctx.settings, ctx.scored, ctx.cache, ctx.update_in_backward,
            term_backward, rows_need_grad=ctx.needs_input_grad[1],
        )
        if ctx.cache is not None:
            ctx.cache.release()
            ctx.cache = None
        grad_positive = None if positive_coef is None else (grad_loss.float() * positive_coef).to(ctx.positive_dtype)
        return grad_features, grad_weight, None, None, None, None, None, None, None, None, None, grad_positive


def _start_term_backward(ctx, grad_term, column_signs, shift_base2, targets: _TargetsByChunk):
    """The term's backward, once the chunk loop knows the column signs and the softmax shift."""
    kernel_pass = _kernel_pass(grad_term.shape[0], ctx.ranks, ctx.scored, targets, ctx.settings, ctx.has_positive)
    return ctx.term.start_backward(kernel_pass, ctx.term_saved, grad_term, column_signs, shift_base2)


def _backward_chunks(scaled_features, weight, target_cols, row_scale, log_normalizer, target_grad,
                     settings: KernelSettings, scored: ScoredRows, cache: LogitsCache | None, update,
                     term_backward=None, rows_need_grad: bool = True):
    """``dL/dz_ij = row_scale_i exp(z_ij - log_normalizer_i) - target_grad_ik`` (plus a term's, when
    ``term_backward(column_signs, shift_base2, targets)`` starts its backward), pushed through the
    chunk matmuls into the features and (or the in-backward update of) the scored rows.  Rows that
    need no gradient (``rows_need_grad`` False, a queue of keys) get none: no weight-gradient matmul."""
    batch, dim = scaled_features.shape
    device = scaled_features.device
    grad_features = torch.zeros(batch, dim, device=device)
    trains_rows = update is not None or rows_need_grad
    grad_weight = None if update is not None or not trains_rows else scored.gradient_for(weight)
    feature_scale, weight_scale = scales(settings.temperature, scaled_features.dtype)
    workspace = ChunkWorkspace(
        batch,
        min(settings.chunk_size, scored.count),
        dim,
        scaled_features.dtype,
        device,
        gathers_rows=scored.indices is not None,
        weight_scale=weight_scale,
    )
    signs, signed_features = None, scaled_features
    # A cache of exp(z) is rescaled per column; a term needs the logits themselves.
    scales_cache = cache is not None and term_backward is None
    if scales_cache:
        cache_scale = (row_scale * torch.exp(-log_normalizer))[None, :]
    else:
        # exp(z - shift) = |row_scale| p, the scale riding in the matmul's output write.  A zero
        # scale (padding) gives shift = +inf and exactly zero gradient.
        shift_base2 = (log_normalizer - torch.log(row_scale.abs())) * LOG2_E
        # A negative row_scale (a loss backpropagated with a negative weight) flips its sample's
        # column.  Rather than a pass over every chunk (or a host sync to see whether one is needed),
        # the sign goes where it costs O(B): into the targets, into the features the weight gradient
        # multiplies, and onto the feature gradient at the end.
        signs = torch.where(row_scale < 0, -1.0, 1.0)
        target_grad = target_grad * signs[:, None]
        signed_features = scaled_features * signs[:, None].to(scaled_features.dtype)
    targets, minus_target_grad = _TargetsByChunk(target_cols, settings.chunk_size), -target_grad.t()
    term = None if term_backward is None else term_backward(signs, shift_base2, targets)
    for start, end in scored.chunks(settings.chunk_size):
        weight_hat, norm = workspace.normalized_rows(scored.read(weight, start, end, workspace.gathered_rows))
        grad_logits = workspace.logits(end - start)
        target_rows, inside = targets.in_chunk(start, end - start)
        if scales_cache:
            torch.mul(cache.chunk(start, end), cache_scale, out=grad_logits)
        elif term is None:
            workspace.cosine_logits(scaled_features, weight_hat, grad_logits, shift_base2).exp2_()
        else:  # dL/dz from the unshifted logits (the cache's, or recomputed into the buffer)
            logits = (
                cache.chunk(start, end)
                if cache is not None
                else workspace.cosine_logits(scaled_features, weight_hat, grad_logits)
            )
            grad_logits = term.grad_logits(logits, start // settings.chunk_size)
        add_into_rows(grad_logits, target_rows, torch.where(inside, minus_target_grad, 0.0))
        workspace.add_grad_features(grad_features, grad_logits, weight_hat)
        if not trains_rows:
            continue
        rows = scored.rows_of(start, end)
        # Contiguous rows of a full gradient are written in place by the matmul.
        direct = grad_weight[rows] if grad_weight is not None and isinstance(rows, slice) else None
        # z = w_hat . signed_features / (feature_scale tau)
        grad_rows = workspace.grad_weight_rows(
            grad_logits, signed_features, weight_hat, norm, feature_scale * settings.temperature, out=direct
        )
        if update is not None:
            update.apply_rows(rows, grad_rows)  # later chunks never read these rows
        elif direct is None:
            add_rows(grad_weight, rows, grad_rows)  # a row sampled twice gets both contributions
    if signs is not None:
        grad_features.mul_(signs[:, None])
    # dz/dx = w_hat / tau: the 1/tau is applied once here rather than per chunk.
    grad_features = grad_features.mul_(1.0 / settings.temperature).to(scaled_features.dtype)
    return grad_features, grad_weight
