"""CO2's per-chunk math: the functions the fused term runs on each chunk of logits.

Both are single functions over one chunk's base-2 logits, so that ``trainer.classifier.terms.inductor_fusion``
compiles each into one loop over the chunk; eager PyTorch would read the chunk once per op
(~25 passes).  Every value is indexed by (row, rank, sample) with the views as separate tensors, so
all of a chunk's reductions share one iteration space and inductor fuses them.  The same functions
run on every device (Triton on GPUs, inductor's C++ on CPU ranks, eagerly where neither can
compile), so the tests exercise the code GPUs run.  The term itself, and the derivation, are in
``trainer.classifier.terms.co2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.classifier.terms.inductor_fusion import fused


@dataclass(frozen=True)
class ChunkMath:
    """What the per-chunk functions need besides tensors (plain values, fixed for a step)."""

    grid: tuple[int, int, int]  # (ranks, views, b): the batch's layout
    global_views: int
    pairs: tuple[tuple[int, int], ...]
    ratio: float  # tau / tau_con: s (base 2) = ratio * z (base 2)
    power: int | None  # ratio when it is 2, 3 or 4: exp(s) = exp(z) ** power, no second exp2

    @classmethod
    def of(cls, settings, kernel_temperature: float, batch: int, ranks: int) -> ChunkMath:
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
                    own: torch.Tensor, math_: ChunkMath) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
                 own: torch.Tensor, coefficients: torch.Tensor, math_: ChunkMath) -> torch.Tensor:
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
            grads[view] = (
                grads[view] + term_exps[view] * (offset + slope * difference) + term_exps[other] * other_factor
            )
    for view in range(math_.global_views, math_.grid[1]):  # small crops: the kernel's part only
        grads.append(torch.exp2(grid[:, :, view] - shift_grid[:, view]))
    # A fresh result: written over the logits, inductor would write this block anyway and copy it
    # over them (it does not overwrite an input read across views).  Stacked, because inductor then
    # computes each view's values once per element (per-view copies compute every view's expression
    # and select).
    return torch.stack(grads, dim=2).view(rows, -1)


fused_add_chunk_sums = fused(_add_chunk_sums)
fused_grad_logits = fused(_grad_logits)
