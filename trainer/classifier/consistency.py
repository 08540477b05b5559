"""CO2's consistency term (seed 004), fused into the chunked cosine-softmax kernel.

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

One pass per chunk: the forward's sums (the kernel's own ``sum exp(z)`` included) and the
backward's ``dL/dz`` are each one function over the chunk's logits, which ``trainer.classifier.fusion``
compiles into a single loop; eager PyTorch would read the chunk once per op (~25 passes).  Every
value is indexed by (row, rank, sample) with the views as separate tensors, so all of a chunk's
reductions share one iteration space and inductor fuses them.  The same functions run on every
device (Triton on GPUs, inductor's C++ on CPU ranks, eagerly where neither can compile), so the
tests exercise the code GPUs run.

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

from trainer.classifier.fusion import fused
from trainer.classifier.losses import sum_over_valid
from trainer.classifier.reductions import SampleColumns

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


@dataclass(frozen=True)
class _ChunkMath:
    """What the per-chunk functions need besides tensors (plain values, fixed for a step)."""

    grid: tuple[int, int, int]  # (ranks, views, b): the batch's layout
    global_views: int
    pairs: tuple[tuple[int, int], ...]
    ratio: float  # tau / tau_con: s (base 2) = ratio * z (base 2)
    power: int | None  # ratio when it is 2, 3 or 4: exp(s) = exp(z) ** power, no second exp2

    @classmethod
    def of(cls, settings: ConsistencySettings, kernel_temperature: float, batch: int, ranks: int) -> _ChunkMath:
        if batch % (ranks * settings.views):
            raise ValueError(f"a batch of {batch} rows is not {ranks} ranks x {settings.views} views of equal "
                             "local batches")
        ratio = kernel_temperature / settings.temperature
        nearest = round(ratio)
        # No overflow from the power: |ratio * z| = |s| <= 1/tau_con <= 50.
        power = nearest if nearest in (2, 3, 4) and abs(ratio - nearest) < 1e-9 else None
        grid = (ranks, settings.views, batch // (ranks * settings.views))
        return cls(grid, settings.global_views, settings.pairs, ratio, power)

    def term_exps(self, logits: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
        """``exp(s)`` from a view's base-2 logits and their ``exp2``."""
        if self.power is None:
            return torch.exp2(logits * self.ratio)
        result = exps
        for _ in range(self.power - 1):
            result = result * exps
        return result

    def own_positions_by_chunk(self, own_chunk: torch.Tensor, own_row: torch.Tensor, chunks: int) -> torch.Tensor:
        """``[chunks, ranks, views, b]`` float position of each column's own row in each chunk, -1
        where it is elsewhere: one table per pass, so a chunk costs an index rather than a few ops.
        Floats, because an int64 select inside the fused loop does not vectorise and a float compare
        does.  ``own_chunk``/``own_row``: ``[B]`` chunk (-1: none) and row of each column's own row."""
        # One spare last row takes the columns whose own row is in no chunk (own_chunk == -1).
        table = torch.full((chunks + 1, own_row.shape[0]), -1.0, device=own_row.device)
        columns = torch.arange(own_row.shape[0], device=own_row.device)
        table[own_chunk, columns] = own_row.float()
        return table[:chunks].view(chunks, *self.grid)

    @staticmethod
    def without_own_rows(values: torch.Tensor, own_position: torch.Tensor) -> torch.Tensor:
        """``values`` ``[rows, ranks, b]`` with each column's own row (``own_position`` ``[ranks, b]``) zeroed."""
        position = torch.arange(values.shape[0], device=values.device, dtype=torch.float32)[:, None, None]
        return torch.where(position == own_position[None], 0.0, values)


def _add_chunk_sums(kernel_sum: torch.Tensor, sum_exp: torch.Tensor, expect: torch.Tensor, logits: torch.Tensor,
                    own: torch.Tensor, math_: _ChunkMath) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three sums plus one chunk's: the kernel's own ``sum_j exp(z)`` of every column (``[B]``)
    and the term's ``S`` (``[ranks, G, b]``) and ``U`` under each view of each pair
    (``[pairs, 2, ranks, b]``, base-2 ``d``)."""
    rows = logits.shape[0]
    grid = logits.view(rows, *math_.grid)
    kernel_sums, term_sums, term_exps = [], [], []
    for view in range(math_.global_views):
        exps = torch.exp2(grid[:, :, view])
        kernel_sums.append(exps.sum(0))
        term = math_.without_own_rows(math_.term_exps(grid[:, :, view], exps), own[:, view])
        term_exps.append(term)
        term_sums.append(term.sum(0))
    expectations = []
    for a, b in math_.pairs:
        difference = grid[:, :, a] - grid[:, :, b]
        expectations.append(torch.stack([(term_exps[a] * difference).sum(0), (term_exps[b] * difference).sum(0)]))
    chunk_kernel_sum = torch.stack(kernel_sums, dim=1)
    if math_.global_views < math_.grid[1]:  # small crops: the kernel's sum only
        chunk_kernel_sum = torch.cat([chunk_kernel_sum, torch.exp2(grid[:, :, math_.global_views:]).sum(0)], dim=1)
    return (kernel_sum + chunk_kernel_sum.view(-1), sum_exp + torch.stack(term_sums, dim=1),
            expect + torch.stack(expectations))


def _grad_logits(logits: torch.Tensor, shift: torch.Tensor, column_factor: torch.Tensor,
                 own: torch.Tensor, coefficients: torch.Tensor, math_: _ChunkMath) -> torch.Tensor:
    """``exp2(z - shift) + dL_con/dz`` ``[rows, B]`` from one chunk's base-2 logits ``z``
    (``coefficients`` ``[3, pairs, 2, ranks, b]``, see ``ConsistencyBackward``)."""
    rows = logits.shape[0]
    grid = logits.view(rows, *math_.grid)
    shift_grid, factor_grid = shift.view(math_.grid), column_factor.view(math_.grid)
    grads, term_exps = [], []
    for view in range(math_.global_views):
        if math_.power is None:
            grads.append(torch.exp2(grid[:, :, view] - shift_grid[:, view]))
            term = math_.term_exps(grid[:, :, view], None)
        else:  # one exp2 serves both: exp2(z - shift) = exp2(z) * exp2(-shift)
            exps = torch.exp2(grid[:, :, view])
            grads.append(exps * factor_grid[:, view])
            term = math_.term_exps(grid[:, :, view], exps)
        term_exps.append(math_.without_own_rows(term, own[:, view]))
    for pair, (a, b) in enumerate(math_.pairs):
        difference = grid[:, :, a] - grid[:, :, b]
        for side, (view, other) in enumerate(((a, b), (b, a))):
            offset, slope, other_factor = coefficients[:, pair, side]
            grads[view] = grads[view] + term_exps[view] * (offset + slope * difference) + term_exps[other] * other_factor
    for view in range(math_.global_views, math_.grid[1]):  # small crops: the kernel's part only
        grads.append(torch.exp2(grid[:, :, view] - shift_grid[:, view]))
    # A fresh result: written over the logits, inductor would write this block anyway and copy it
    # over them (it does not overwrite an input read across views).  Stacked, because inductor then
    # computes each view's values once per element (per-view copies compute every view's expression
    # and select).
    return torch.stack(grads, dim=2).view(rows, -1)


_fused_add_chunk_sums = fused(_add_chunk_sums)
_fused_grad_logits = fused(_grad_logits)


class ConsistencyForward:
    """Accumulates the per-sample sums of the term over the chunks of the forward."""

    def __init__(self, settings: ConsistencySettings, kernel_temperature: float, batch: int, ranks: int,
                 own_chunk: torch.Tensor, own_row: torch.Tensor, chunks: int) -> None:
        """``own_chunk``/``own_row``: ``[B]`` chunk (-1: none) and row there of each column's own
        row; ``chunks``: how many chunks the pass has."""
        self.settings = settings
        self.math = _ChunkMath.of(settings, kernel_temperature, batch, ranks)
        self.own = self.math.own_positions_by_chunk(own_chunk, own_row, chunks)
        ranks_, _, local = self.math.grid
        self.sum_exp = torch.zeros(ranks_, settings.global_views, local, device=own_row.device)
        self.expect = torch.zeros(len(settings.pairs), 2, ranks_, local, device=own_row.device)

    def add_chunk(self, kernel_sum: torch.Tensor, logits: torch.Tensor, chunk: int) -> torch.Tensor:
        """Adds the chunk's sums; returns the kernel's ``kernel_sum`` ``[B]`` plus the chunk's
        ``sum_j exp(z)``.  ``logits``: the chunk's base-2 logits ``[rows, B]`` (left as they are);
        ``chunk``: its index in the pass."""
        kernel_sum, self.sum_exp, self.expect = _fused_add_chunk_sums(
            kernel_sum, self.sum_exp, self.expect, logits, self.own[chunk], self.math, compiled=self.settings.compiled
        )
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

    def __init__(self, settings: ConsistencySettings, kernel_temperature: float, saved: ConsistencySaved,
                 grad_term: torch.Tensor, column_signs: torch.Tensor | None, shift_base2: torch.Tensor,
                 ranks: int, own_chunk: torch.Tensor, own_row: torch.Tensor, chunks: int) -> None:
        """``grad_term``: ``[B]`` upstream gradient of the per-column term; ``column_signs``: ``[B]``
        signs the kernel applies to whole columns after the chunk loop (None: all +1), undone here;
        ``shift_base2``: the kernel's ``[B]`` shift of its own softmax (``+inf`` zeroes a column);
        the rest as in ``ConsistencyForward``."""
        self.settings = settings
        self.math = _ChunkMath.of(settings, kernel_temperature, grad_term.shape[0], ranks)
        self.own = self.math.own_positions_by_chunk(own_chunk, own_row, chunks)
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
        return _fused_grad_logits(logits, self.shift_base2, self.column_factor, self.own[chunk], self.coefficients,
                                  self.math, compiled=self.settings.compiled)


def settings_for_views(temperature: float, view_kinds: list[str], compiled: bool = True) -> ConsistencySettings:
    """The term's settings for a batch whose views have these kinds (global views come first)."""
    global_views = sum(kind == "global" for kind in view_kinds)
    if global_views < 2 or any(kind == "global" for kind in view_kinds[global_views:]):
        raise ValueError(f"co2_alpha > 0 needs at least two global views per image, first in the batch (the views "
                         f"are {view_kinds}); set data.loader.augment.num_views: 2 or co2_alpha: 0")
    return ConsistencySettings(temperature, len(view_kinds), global_views, compiled)


def weighted_sum(per_sample: torch.Tensor, term: torch.Tensor, valid: torch.Tensor, alpha: float,
                 settings: ConsistencySettings) -> torch.Tensor:
    """``sum(valid * loss) + alpha * sum(valid * term) * views / global_views``: divided by the
    number of valid columns (all views) this is the instance loss's mean plus alpha times the
    term's mean over the global views, so the caller's denominator serves both."""
    scale = alpha * settings.views / settings.global_views
    return sum_over_valid(per_sample, valid) + scale * sum_over_valid(term, valid)
