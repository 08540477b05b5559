"""CO2's consistency term (Wei et al., ICLR 2021), fused into the chunked cosine-softmax kernel.

For an image with global views a and b, the negatives are the scored rows other than its own;
``s_j = <x, w_j/|w_j|> / tau_con``, ``P = softmax(s_a)``, ``Q = softmax(s_b)`` over them and
``d_j = s_a,j - s_b,j``.  Since ``log P_j - log Q_j = d_j - (lse_a - lse_b)`` and both sum to 1,
``KL(P||Q) + KL(Q||P) = sum_j (P_j - Q_j) d_j``, so ``L_con = (E_P[d] - E_Q[d]) / 2``.  Per sample
the chunk loop therefore needs ``S = sum_j exp(s_j)`` of each view and ``U = sum_j exp(s_j) d_j``
under each view of a pair.  ``s`` is the chunk's logits times ``tau / tau_con`` (no extra matmul);
``|s| <= 1/tau_con <= 50`` so plain fp32 sums need no running max, and they travel as extra
columns of the kernel's SUM all-reduce (no extra collective).  The gradient per chunk,
``dL/ds_a,j = (P_j (1 + d_j - E_P[d]) - Q_j) / 2`` and ``dL/ds_b,j = (Q_j (1 - d_j + E_Q[d]) - P_j) / 2``,
is added to the chunk's ``dL/dz`` (times ``tau / tau_con``) before the backward's two matmuls.

It is a ``trainer.classifier.terms.chunk_term.ChunkTerm``: one pass per chunk computes the forward's sums
(the kernel's own ``sum exp(z)`` included) and one the backward's ``dL/dz``; both are fused
functions over the chunk's logits (``trainer.classifier.terms.co2_math``), both compiled during
the forward (the backward's for each chunk shape the forward sees).

Layout: the kernel's batch is the group's features in all-gather order, ``[ranks, views, b]``;
the first ``global_views`` views take part (small crops do not: their similarity profile over the
rows is not the one a large view should agree with).  With more than two global views every pair
counts and each view's term is the mean over the pairs it is in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import torch

from trainer.classifier.kernel.reductions import SampleColumns
from trainer.classifier.terms.chunk_term import KernelPass
from trainer.classifier.terms.co2_math import ChunkMath, fused_add_chunk_sums, fused_grad_logits

SUM_EXP = "co2_sum_exp"


def _pair_column(pair: int) -> str:
    return f"co2_expect_{pair}"


@dataclass(frozen=True)
class ConsistencySettings:
    """``temperature``: tau_con; ``views``: views per sample in the batch; ``global_views``: the
    first ones, which take part; ``compiled``: fuse each chunk's math with inductor rather than run
    it eagerly."""

    temperature: float = 0.05
    views: int = 2
    global_views: int = 2
    compiled: bool = True

    def __post_init__(self) -> None:
        if not 2 <= self.global_views <= self.views:
            raise ValueError(f"CO2 needs at least 2 global views per sample (got {self.global_views} of "
                             f"{self.views} views)")

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        return tuple(combinations(range(self.global_views), 2))



# Padding rows of a bucketed chunk: base-2 logits whose exp2 is exactly 0 in fp32, finite so that
# the differences between two views' logits stay finite (-inf - -inf would be NaN).
PAD_LOGIT = -1.0e4


def bucketed_rows(rows: int) -> int:
    """The row count a chunk is padded to when row counts vary by step: the next power of two (at
    least 64), so the fused functions are compiled for a dozen shapes at most, not one per step."""
    return max(64, 1 << (rows - 1).bit_length())


def padded_to_bucket(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[rows, B]`` with ``PAD_LOGIT`` rows appended up to ``bucketed_rows(rows)``.
    A padding row adds 0 to every sum of the term, and its gradient rows are dropped."""
    rows, batch = logits.shape
    bucket = bucketed_rows(rows)
    if bucket == rows:
        return logits
    padded = logits.new_empty(bucket, batch)
    padded[:rows] = logits
    padded[rows:] = PAD_LOGIT
    return padded


class ConsistencyForward:
    """Accumulates the per-sample sums of the term over the chunks of the forward."""

    def __init__(self, settings: ConsistencySettings, kernel_pass: KernelPass) -> None:
        self.settings = settings
        self.bucketed = kernel_pass.rows_vary
        self.math = ChunkMath.of(settings, kernel_pass.temperature, kernel_pass.batch, kernel_pass.ranks)
        self.own = self.math.own_positions_by_chunk(kernel_pass.own_chunk, kernel_pass.own_row, kernel_pass.chunks)
        ranks, _, local = self.math.grid
        device = kernel_pass.own_row.device
        self.sum_exp = torch.zeros(ranks, settings.global_views, local, device=device)
        self.expect = torch.zeros(len(settings.pairs), 2, ranks, local, device=device)
        # Stand-ins with the layout of the backward's per-column inputs (see ConsistencyBackward),
        # so that its fused function is compiled here, not inside the backward.
        batch = kernel_pass.batch
        self._backward_columns = (torch.zeros(batch, device=device), torch.zeros(batch, device=device))
        self._backward_coefficients = torch.zeros(3, len(settings.pairs), 2, ranks, local, device=device)

    def add_chunk(self, kernel_sum: torch.Tensor, logits: torch.Tensor, chunk: int) -> torch.Tensor:
        """Adds the chunk's sums; returns the kernel's ``kernel_sum`` ``[B]`` plus the chunk's
        ``sum_j exp(z)``.  ``logits``: the chunk's base-2 logits ``[rows, B]`` (left as they are);
        ``chunk``: its index in the pass."""
        if self.bucketed:
            logits = padded_to_bucket(logits)
        kernel_sum, self.sum_exp, self.expect = fused_add_chunk_sums(
            kernel_sum, self.sum_exp, self.expect, logits, self.own[chunk], self.math, compiled=self.settings.compiled
        )
        # Every chunk shape of the pass (the last chunk may be shorter); a dict lookup once compiled.
        fused_grad_logits.prepare(logits, *self._backward_columns, self.own[chunk], self._backward_coefficients,
                                  self.math, compiled=self.settings.compiled)
        return kernel_sum

    def columns(self) -> SampleColumns:
        """The sums as ``[B]`` columns of the SUM all-reduce (0 in the other views' columns)."""
        ranks, views, local = self.math.grid
        sum_exp = self.sum_exp.new_zeros(ranks, views, local)
        sum_exp[:, : self.settings.global_views] = self.sum_exp
        sums = {SUM_EXP: sum_exp.view(-1)}
        for pair, (a, b) in enumerate(self.settings.pairs):
            expect = self.sum_exp.new_zeros(ranks, views, local)
            expect[:, a], expect[:, b] = self.expect[pair, 0], self.expect[pair, 1]
            sums[_pair_column(pair)] = expect.view(-1)
        return SampleColumns(sums=sums)

    def finish(self, reduced: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ConsistencySaved]:
        """``(per-column term [B], what the backward needs)`` from the group-reduced sums.  Each global
        column holds the mean of ``L_con`` over the pairs it is in; other columns hold 0."""
        grid = self.math.grid
        # E[d] in natural units: d = ratio * ln 2 * (difference of base-2 logits).
        to_natural = self.math.ratio * math.log(2.0)
        sum_exp = reduced[SUM_EXP].view(grid)
        term = torch.zeros_like(reduced[SUM_EXP])
        term_grid = term.view(grid)
        share = 1.0 / (self.settings.global_views - 1)
        expectations = []
        for pair, (a, b) in enumerate(self.settings.pairs):
            expect = reduced[_pair_column(pair)].view(grid)
            under_a = to_natural * expect[:, a] / sum_exp[:, a]
            under_b = to_natural * expect[:, b] / sum_exp[:, b]
            pair_term = 0.5 * (under_a - under_b)
            term_grid[:, a] += share * pair_term
            term_grid[:, b] += share * pair_term
            expectations.append((under_a, under_b))
        return term, ConsistencySaved(sum_exp[:, : self.settings.global_views], expectations)


@dataclass
class ConsistencySaved:
    """Per-sample values the backward needs: ``S`` of every global column ``[ranks, G, b]`` and,
    per pair, ``(E_P[d], E_Q[d])`` as ``[ranks, b]`` each."""

    sum_exp: torch.Tensor
    expectations: list[tuple[torch.Tensor, torch.Tensor]]


class ConsistencyBackward:
    """Writes each chunk's ``dL/dz``: the kernel's softmax part and the term's, in one pass.

    Over a pair's two views (``X`` a view's own distribution, ``Y`` the other's, ``sigma`` +1 for
    the first view and -1 for the second) both gradients are ``X (1 - sigma E_X[d] + sigma d) - Y``,
    with ``X = exp(s) / S`` kept unnormalised; ``1/S`` and the upstream gradient go into three
    per-column coefficients, ``dL/dz = exp(s) (offset + slope d) + exp(s of the other view) other``."""

    def __init__(self, settings: ConsistencySettings, kernel_pass: KernelPass, saved: ConsistencySaved,
                 grad_term: torch.Tensor, column_signs: torch.Tensor | None, shift_base2: torch.Tensor) -> None:
        """Arguments as in ``ChunkTerm.start_backward``; ``column_signs`` None: all +1."""
        self.settings = settings
        self.bucketed = kernel_pass.rows_vary
        self.math = ChunkMath.of(settings, kernel_pass.temperature, kernel_pass.batch, kernel_pass.ranks)
        self.own = self.math.own_positions_by_chunk(kernel_pass.own_chunk, kernel_pass.own_row, kernel_pass.chunks)
        grid = self.math.grid
        self.shift_base2 = shift_base2.contiguous()
        self.column_factor = torch.exp2(-shift_base2)
        to_natural = self.math.ratio * math.log(2.0)
        grad_grid = grad_term.float().view(grid)
        signs = None if column_signs is None else column_signs.view(grid)
        inverse_sum = 1.0 / saved.sum_exp  # [ranks, G, b]
        share = 1.0 / (settings.global_views - 1)
        coefficients = []
        for pair, (a, b) in enumerate(settings.pairs):
            under_a, under_b = saved.expectations[pair]
            inverse_a, inverse_b = inverse_sum[:, a], inverse_sum[:, b]
            # X (1 - sigma E_X[d] + sigma d) - Y with X = exp(s) / S: the coefficients carry the 1/S.
            offset = torch.stack([(1.0 - under_a) * inverse_a, (1.0 + under_b) * inverse_b])
            slope = torch.stack([to_natural * inverse_a, -to_natural * inverse_b])
            other = torch.stack([-inverse_b, -inverse_a])
            # d(loss)/dz = (upstream of both columns) / (pairs per view) * 1/2 * ds/dz (= ratio).
            scale = (grad_grid[:, a] + grad_grid[:, b]) * (share * 0.5 * self.math.ratio)
            scale = torch.stack([scale, scale])
            if signs is not None:
                scale = scale * torch.stack([signs[:, a], signs[:, b]])
            coefficients.append(torch.stack([offset, slope, other]) * scale)
        self.coefficients = torch.stack(coefficients, dim=1)  # [3, pairs, 2, ranks, b]

    def grad_logits(self, logits: torch.Tensor, chunk: int) -> torch.Tensor:
        """The chunk's ``dL/dz`` ``[rows, B]`` before the targets' part, ``exp2(logits - shift)`` plus
        the term's, from its unshifted base-2 logits (contiguous fp32, left as they are); ``chunk``: its
        index."""
        rows = logits.shape[0]
        if self.bucketed:
            logits = padded_to_bucket(logits)
        grads = fused_grad_logits(logits, self.shift_base2, self.column_factor, self.own[chunk], self.coefficients,
                                  self.math, compiled=self.settings.compiled)
        return grads[:rows]  # the padding rows' gradients are dropped


@dataclass(frozen=True)
class ConsistencyTerm:
    """CO2's term as a ``ChunkTerm`` of the kernel, weighted by ``alpha`` in the loss."""

    settings: ConsistencySettings
    alpha: float = 1.0

    @classmethod
    def for_views(cls, temperature: float, alpha: float, view_kinds, compiled: bool = True) -> ConsistencyTerm:
        """The term for a batch whose views have these kinds (global views come first)."""
        kinds = list(view_kinds)
        global_views = sum(kind == "global" for kind in kinds)
        if global_views < 2 or any(kind == "global" for kind in kinds[global_views:]):
            raise ValueError(f"co2_alpha > 0 needs at least two global views per image, first in the batch (the "
                             f"views are {kinds}); set data.loader.augment.num_views: 2 or co2_alpha: 0")
        return cls(ConsistencySettings(temperature, len(kinds), global_views, compiled), alpha)

    @property
    def weight(self) -> float:
        """The term lives in the global views' columns only: ``views / global_views`` makes the
        loss's mean over all columns the instance loss's mean plus alpha times the term's mean
        over the global views."""
        return self.alpha * self.settings.views / self.settings.global_views

    def start_forward(self, kernel_pass: KernelPass) -> ConsistencyForward:
        return ConsistencyForward(self.settings, kernel_pass)

    def start_backward(self, kernel_pass: KernelPass, saved: ConsistencySaved, grad_term: torch.Tensor,
                       column_signs: torch.Tensor | None, shift_base2: torch.Tensor) -> ConsistencyBackward:
        return ConsistencyBackward(self.settings, kernel_pass, saved, grad_term, column_signs, shift_base2)
