"""The cross-rank reductions of the sharded loss: one MAX and one SUM all-reduce of ``[B, C]``.

Each rank scores its own rows, so every per-sample statistic of the loss is a partial one that must
be combined over the classifier group.  Two kinds of column cover every objective here:

* ``logsumexp`` columns: a local ``log sum_j exp(...)`` over this rank's terms; the group value is
  ``log sum_r exp(v_r)``, computed stably as ``m + log sum_r exp(v_r - m)`` with ``m`` the MAX over
  ranks.  Empty local sums are ``-inf`` and contribute nothing.
* ``sums`` columns: plain sums over ranks.

All columns of one kind travel in the same collective, so an objective that needs more per-sample
statistics (e.g. CO2's extra terms) adds columns, never a third all-reduce.  Both collectives carry
``O(B)`` values: they are the only communication of the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer.parallel.collectives import CommTimer, Group, all_reduce_


@dataclass
class SampleColumns:
    """Per-sample ``[B]`` statistics of this rank, by name, waiting to be combined over ranks."""

    logsumexp: dict[str, torch.Tensor] = field(default_factory=dict)
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, other: SampleColumns) -> SampleColumns:
        """Both sets of columns (an objective's extra columns join the same collectives)."""
        clash = (self.logsumexp.keys() | self.sums.keys()) & (other.logsumexp.keys() | other.sums.keys())
        if clash:
            raise ValueError(f"per-sample columns {sorted(clash)} are defined twice")
        return SampleColumns(self.logsumexp | other.logsumexp, self.sums | other.sums)


def reduce_over_ranks(columns: SampleColumns, group: Group, timer: CommTimer | None = None) -> dict[str, torch.Tensor]:
    """Group values of every column, by name, with exactly two all-reduces (one without
    ``logsumexp`` columns).  The results are constants for autograd: the loss's backward uses
    them as coefficients (see ``trainer.classifier.kernel.losses``)."""
    names = list(columns.logsumexp)
    reduced: dict[str, torch.Tensor] = {}
    sum_columns = list(columns.sums.values())
    if names:
        local = torch.stack([columns.logsumexp[name] for name in names], dim=1)
        group_max = all_reduce_(local.clone(), dist.ReduceOp.MAX, group, timer)
        # A column that is -inf on every rank (nothing to sum anywhere) stays -inf, never NaN.
        shift = torch.where(torch.isinf(group_max), 0.0, group_max)
        sum_columns = [*torch.exp(local - shift).unbind(dim=1), *sum_columns]
    summed = all_reduce_(torch.stack(sum_columns, dim=1), dist.ReduceOp.SUM, group, timer).unbind(dim=1)
    for index, name in enumerate(names):
        reduced[name] = shift[:, index] + torch.log(summed[index])
    for name, value in zip(columns.sums, summed[len(names):]):
        reduced[name] = value
    return reduced
