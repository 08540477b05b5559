"""A per-sample positive logit that is not a row of the weight, shared by both paths of the kernel.

MoCo scores a query ``q_i`` against its own positive key ``k_i`` and a queue of negative keys: the
queue is the kernel's (sharded) rows, the positive ``l_i = <q_i, k_i> / tau`` is a ``[B]`` tensor the
caller computes (with autograd to ``q``, and to ``k`` if it carries one).  It joins the softmax as
one more column of sample i: its ``exp(l_i)`` joins the normaliser and it is a target, the first
of ``1 + K`` (its weight is ``target_weights[:, 0]``, the rows' targets follow).

Exactly one rank of the group holds it (the group's first): there it is added to the local sum of
exponentials and is an owned target, so the two all-reduces count it once.  Its gradient
``dL_i/dl_i = softmax_scale_i exp(l_i - log_normalizer_i) - target_coef_i0`` is that rank's and 0
on the others, like the features' gradient: each rank's share, summed over the group by the
backward of the all-gather the caller computed it from.
"""

from __future__ import annotations

import torch

from trainer.classifier.kernel.losses import LogitGradient, Targets
from trainer.parallel.collectives import Group, group_rank


class PositiveLogit:
    """``logits``: ``[B]`` natural-unit logits (any float dtype), the same on every rank of ``group``."""

    def __init__(self, logits: torch.Tensor, group: Group) -> None:
        if logits.dim() != 1:
            raise ValueError(f"positive_logits must be a [B] tensor (one logit per sample), got "
                             f"{tuple(logits.shape)}")
        self.logits = logits.detach().float()
        self.held = group_rank(group) == 0

    def add_to_sum_exp(self, sum_exp: torch.Tensor) -> torch.Tensor:
        """The local ``sum_j exp(z_ij)`` with the positive's ``exp(l_i)`` on the rank that holds it."""
        if sum_exp.shape != self.logits.shape:
            raise ValueError(f"positive_logits has {self.logits.shape[0]} values for a batch of {sum_exp.shape[0]} "
                             "features: give one per feature row")
        return sum_exp + torch.exp(self.logits) if self.held else sum_exp

    def with_row_targets(self, rows: Targets) -> Targets:
        """The ``1 + K`` targets: the positive first, then the rows' ``K`` (``rows.weights`` is
        already ``[B, 1 + K]``, the positive's weight first)."""
        owned = torch.full_like(self.logits, self.held, dtype=torch.bool)[:, None]
        return Targets(torch.cat([torch.where(owned, self.logits[:, None], 0.0), rows.logits], dim=1),
                       torch.cat([owned, rows.owned], dim=1), rows.weights)

    def split(self, gradient: LogitGradient) -> tuple[LogitGradient, torch.Tensor]:
        """``(the rows' gradient coefficients, dL_i/dl_i [B])`` from those of the ``1 + K`` targets."""
        rows = LogitGradient(gradient.softmax_scale, gradient.log_normalizer, gradient.target_coef[:, 1:])
        if not self.held:
            return rows, torch.zeros_like(self.logits)
        softmax_part = gradient.softmax_scale * torch.exp(self.logits - gradient.log_normalizer)
        return rows, softmax_part - gradient.target_coef[:, 0]
