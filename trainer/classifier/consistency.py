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

from trainer.classifier.chunk_workspace import ChunkWorkspace
from trainer.classifier.losses import sum_over_valid
from trainer.classifier.reductions import SampleColumns

SUM_EXP = "co2_sum_exp"


def _pair_column(pair: int) -> str:
    return f"co2_expect_{pair}"


@dataclass(frozen=True)
class ConsistencySettings:
    """``temperature``: tau_con; ``views``: views per sample in the batch; ``global_views``: the
    first ones, which take part."""

    temperature: float = 0.05
    views: int = 2
    global_views: int = 2

    def __post_init__(self) -> None:
        if not 2 <= self.global_views <= self.views:
            raise ValueError(f"CO2 needs at least 2 global views per sample (got {self.global_views} of "
                             f"{self.views} views)")

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return list(combinations(range(self.global_views), 2))


class _Layout:
    """Views of ``[rows, B]`` chunks (and ``[B]`` columns) as ``[rows, ranks, views, b]``."""

    def __init__(self, settings: ConsistencySettings, batch: int, ranks: int) -> None:
        if batch % (ranks * settings.views):
            raise ValueError(f"a batch of {batch} rows is not {ranks} ranks x {settings.views} views of equal "
                             "local batches")
        self.ranks, self.views, self.local = ranks, settings.views, batch // (ranks * settings.views)
        self.global_views = settings.global_views
        self._columns: tuple[torch.Tensor, ...] | None = None  # (rank, view, sample) index of each global column

    def grid(self, chunk: torch.Tensor) -> torch.Tensor:
        return chunk.view(*chunk.shape[:-1], self.ranks, self.views, self.local)

    def global_part(self, chunk: torch.Tensor) -> torch.Tensor:
        return self.grid(chunk)[..., : self.global_views, :]

    def exclude_own_rows(self, values: torch.Tensor, own_row: torch.Tensor, own_inside: torch.Tensor) -> None:
        """Zero each global column's entry at its own instance's row when that row is in the chunk.

        ``values``: ``[rows, ranks, global_views, b]`` (any strides); ``own_row``/``own_inside``: the
        ``[B]`` position of each column's own row in the chunk and whether it is there."""
        if self._columns is None or self._columns[0].device != values.device:
            shape = (self.ranks, self.global_views, self.local)
            self._columns = torch.meshgrid(*(torch.arange(n, device=values.device) for n in shape), indexing="ij")
        index = (self.global_part(own_row), *self._columns)
        values[index] = torch.where(self.global_part(own_inside), 0.0, values[index])


def _pair(block: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Views a and b (a < b) of a ``[rows, ranks, views, b]`` block as one ``[rows, ranks, 2, b]``
    view: elementwise work on a pair runs as one pass (the whole block when there are 2 views)."""
    return block[:, :, a : b + 1 : b - a]


def _integer_power(ratio: float) -> int | None:
    """``ratio`` when it is 2, 3 or 4 (tau 0.15 or 0.2 over tau_con 0.05): ``exp(s) = exp(z)^ratio``
    is then a cheap power of the exponentials the kernel computes anyway, not another ``exp2`` pass.
    No overflow: ``|ratio * z| = |s| <= 1/tau_con <= 50``."""
    nearest = round(ratio)
    return nearest if nearest in (2, 3, 4) and abs(ratio - nearest) < 1e-9 else None


def _power(values: torch.Tensor, power: int, out: torch.Tensor) -> torch.Tensor:
    if power == 4:  # torch's pow has fast paths for 2 and 3 only
        return torch.square(values, out=out).square_()
    return torch.pow(values, power, out=out)


class ConsistencyForward:
    """Accumulates the per-sample sums of the term over the chunks of the forward.

    Per chunk the kernel calls ``before_exp`` with its base-2 logits, then exponentiates them (in
    place) and calls ``after_exp`` with ``exp(z)``."""

    def __init__(self, settings: ConsistencySettings, kernel_temperature: float, batch: int, ranks: int,
                 workspace: ChunkWorkspace, device: torch.device) -> None:
        self.settings, self.workspace = settings, workspace
        self.layout = _Layout(settings, batch, ranks)
        # Chunk logits are base 2 at the kernel's tau: s (natural, at tau_con) = ratio * ln 2 * logit.
        self.ratio = kernel_temperature / settings.temperature
        self.power = _integer_power(self.ratio)
        self.sum_exp = torch.zeros(batch, device=device)
        self.expect = [torch.zeros(batch, device=device) for _ in settings.pairs]

    def _block(self, name: str, rows: int, views: int) -> torch.Tensor:
        layout = self.layout
        return self.workspace.block(name, rows, layout.ranks, views, layout.local)

    def before_exp(self, logits: torch.Tensor) -> None:
        """``logits``: the chunk's base-2 logits ``[rows, B]``, before the kernel exponentiates them."""
        layout, rows = self.layout, logits.shape[0]
        grid = layout.grid(logits)
        self.diffs = [torch.sub(grid[:, :, a], grid[:, :, b], out=self._block(f"co2_diff{pair}", rows, 1)[:, :, 0])
                      for pair, (a, b) in enumerate(self.settings.pairs)]
        if self.power is None:
            exps = self._block("co2_exp", rows, layout.global_views)
            torch.mul(layout.global_part(logits), self.ratio, out=exps).exp2_()

    def after_exp(self, kernel_exps: torch.Tensor, own_row: torch.Tensor, own_inside: torch.Tensor) -> None:
        """``kernel_exps``: the chunk's ``exp(z)`` ``[rows, B]``, which the kernel no longer needs (it
        may be overwritten); ``own_row``/``own_inside``: ``[B]`` position of each column's own row in
        the chunk and whether it is there."""
        layout, rows = self.layout, kernel_exps.shape[0]
        if self.power is None:
            exps = self._block("co2_exp", rows, layout.global_views)
        else:  # in place: a separate output would double the memory traffic of this pass
            exps = _power(layout.global_part(kernel_exps), self.power, out=layout.global_part(kernel_exps))
        layout.exclude_own_rows(exps, own_row, own_inside)
        layout.global_part(self.sum_exp).add_(exps.sum(dim=0))
        product = self._block("co2_product", rows, 2)
        for pair, (a, b) in enumerate(self.settings.pairs):
            torch.mul(_pair(exps, a, b), self.diffs[pair][:, :, None, :], out=product)
            _pair(layout.grid(self.expect[pair])[None], a, b)[0].add_(product.sum(dim=0))

    def columns(self) -> SampleColumns:
        sums = {SUM_EXP: self.sum_exp}
        sums.update({_pair_column(pair): expect for pair, expect in enumerate(self.expect)})
        return SampleColumns(sums=sums)

    def finish(self, reduced: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ConsistencySaved]:
        """``(per-column term [B], what the backward needs)`` from the group-reduced sums.  Each global
        column holds the mean of ``L_con`` over the pairs it is in; other columns hold 0."""
        layout = self.layout
        # E[d] in natural units: d = ratio * ln 2 * (difference of base-2 logits).
        to_natural = self.ratio * math.log(2.0)
        sum_exp = layout.grid(reduced[SUM_EXP])
        term = torch.zeros_like(reduced[SUM_EXP])
        term_grid = layout.grid(term)
        share = 1.0 / (layout.global_views - 1)
        expectations = []
        for pair, (a, b) in enumerate(self.settings.pairs):
            expect = layout.grid(reduced[_pair_column(pair)])
            under_a = to_natural * expect[:, a] / sum_exp[:, a]
            under_b = to_natural * expect[:, b] / sum_exp[:, b]
            pair_term = 0.5 * (under_a - under_b)
            term_grid[:, a] += share * pair_term
            term_grid[:, b] += share * pair_term
            expectations.append((under_a, under_b))
        return term, ConsistencySaved(layout.global_part(reduced[SUM_EXP]), expectations)


@dataclass
class ConsistencySaved:
    """Per-sample values the backward needs: ``S`` of every global column ``[ranks, G, b]`` and,
    per pair, ``(E_P[d], E_Q[d])`` as ``[ranks, b]`` each."""

    sum_exp: torch.Tensor
    expectations: list[tuple[torch.Tensor, torch.Tensor]]


class ConsistencyBackward:
    """Adds the term's ``dL/dz`` to each chunk's logit gradient.

    Per chunk the kernel calls ``softmax_exps`` for its own ``exp(z - shift)`` (which shares the
    exponentials with the term's when ``tau / tau_con`` is a small integer), then ``add_chunk``.
    Over a pair's two views (``X`` a view's own distribution, ``Y`` the other's, ``sigma`` +1 for
    the first view and -1 for the second) both gradients are ``X (1 - sigma E_X[d] + sigma d) - Y``,
    with ``X = exp(s) / S`` kept unnormalised and ``1/S`` folded into per-column coefficients, so
    each step runs once over the pair's ``[rows, ranks, 2, b]`` view."""

    def __init__(self, settings: ConsistencySettings, kernel_temperature: float, saved: ConsistencySaved,
                 grad_term: torch.Tensor, column_signs: torch.Tensor | None, shift_base2: torch.Tensor,
                 workspace: ChunkWorkspace, ranks: int) -> None:
        """``grad_term``: ``[B]`` upstream gradient of the per-column term; ``column_signs``: ``[B]``
        signs the kernel applies to whole columns after the chunk loop (None: all +1), undone here;
        ``shift_base2``: the kernel's ``[B]`` shift of its own softmax (``+inf`` zeroes a column)."""
        self.settings, self.workspace = settings, workspace
        self.layout = layout = _Layout(settings, grad_term.shape[0], ranks)
        self.ratio = kernel_temperature / settings.temperature
        self.power = _integer_power(self.ratio)
        self.shift_base2 = shift_base2
        self.column_factor = torch.exp2(-shift_base2) if self.power is not None else None
        to_natural = self.ratio * math.log(2.0)
        grad_grid = layout.grid(grad_term.float())
        signs = None if column_signs is None else layout.grid(column_signs)
        inverse_sum = 1.0 / saved.sum_exp  # [ranks, G, b]
        share = 1.0 / (layout.global_views - 1)
        sigma = torch.tensor([1.0, -1.0], device=grad_term.device)[:, None]
        self.offsets, self.slopes, self.minus_other, self.scales = [], [], [], []
        for pair, (a, b) in enumerate(settings.pairs):
            under_a, under_b = saved.expectations[pair]
            inverse = _pair(inverse_sum[None], a, b)[0]  # [ranks, 2, b]
            # X (1 - sigma E_X[d] + sigma d) with X = exp(s) / S: offset and slope carry the 1/S.
            self.offsets.append(torch.stack([1.0 - under_a, 1.0 + under_b], dim=1) * inverse)
            self.slopes.append(sigma * to_natural * inverse)
            self.minus_other.append(-inverse.flip(1))  # Y = exp(s of the other view) / its S
            # d(loss)/dz = (upstream of both columns) / (pairs per view) * 1/2 * ds/dz (= ratio).
            scale = (grad_grid[:, a] + grad_grid[:, b]) * (share * 0.5 * self.ratio)
            scale = torch.stack([scale, scale], dim=1)
            self.scales.append(scale if signs is None else scale * _pair(signs[None], a, b)[0])

    def softmax_exps(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The kernel's ``exp2(logits - shift)`` into ``out``; keeps the term's unnormalised
        ``exp(s)`` of the global columns for ``add_chunk``."""
        layout, rows = self.layout, logits.shape[0]
        self.exps = self.workspace.block("co2_exp", rows, layout.ranks, layout.global_views, layout.local)
        if self.power is None:
            torch.mul(layout.global_part(logits), self.ratio, out=self.exps).exp2_()
            return torch.sub(logits, self.shift_base2[None, :], out=out).exp2_()
        torch.exp2(logits, out=out)
        _power(layout.global_part(out), self.power, out=self.exps)
        return out.mul_(self.column_factor[None, :])

    def add_chunk(self, grad_logits: torch.Tensor, logits: torch.Tensor, own_row: torch.Tensor,
                  own_inside: torch.Tensor) -> None:
        """``grad_logits``: the chunk's ``dL/dz`` ``[rows, B]``, updated in place; ``logits``: its
        base-2 logits (unshifted); ``own_row``/``own_inside``: ``[B]`` position of each column's own
        row in the chunk and whether it is there."""
        layout, rows = self.layout, logits.shape[0]
        exps = self.exps
        layout.exclude_own_rows(exps, own_row, own_inside)
        diff = self.workspace.block("co2_diff0", rows, layout.ranks, 1, layout.local)
        work = self.workspace.block("co2_product", rows, layout.ranks, 2, layout.local)
        grid, grad_grid = layout.grid(logits), layout.grid(grad_logits)
        for pair, (a, b) in enumerate(self.settings.pairs):
            torch.sub(grid[:, :, a], grid[:, :, b], out=diff[:, :, 0])
            pair_exps = _pair(exps, a, b)
            torch.addcmul(self.offsets[pair], self.slopes[pair], diff, out=work).mul_(pair_exps)
            minus_other = self.minus_other[pair]
            work[:, :, 0].addcmul_(pair_exps[:, :, 1], minus_other[:, 0])
            work[:, :, 1].addcmul_(pair_exps[:, :, 0], minus_other[:, 1])
            _pair(grad_grid, a, b).addcmul_(work, self.scales[pair])


def settings_for_views(temperature: float, view_kinds: list[str]) -> ConsistencySettings:
    """The term's settings for a batch whose views have these kinds (global views come first)."""
    global_views = sum(kind == "global" for kind in view_kinds)
    if global_views < 2 or any(kind == "global" for kind in view_kinds[global_views:]):
        raise ValueError(f"co2_alpha > 0 needs at least two global views per image, first in the batch (the views "
                         f"are {view_kinds}); set data.loader.augment.num_views: 2 or co2_alpha: 0")
    return ConsistencySettings(temperature, len(view_kinds), global_views)


def weighted_sum(per_sample: torch.Tensor, term: torch.Tensor, valid: torch.Tensor, alpha: float,
                 settings: ConsistencySettings) -> torch.Tensor:
    """``sum(valid * loss) + alpha * sum(valid * term) * views / global_views``: divided by the
    number of valid columns (all views) this is the instance loss's mean plus alpha times the
    term's mean over the global views, so the caller's denominator serves both."""
    scale = alpha * settings.views / settings.global_views
    return sum_over_valid(per_sample, valid) + scale * sum_over_valid(term, valid)
