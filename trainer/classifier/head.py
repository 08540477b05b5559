"""The class-sharded cosine head that ``instance`` and ``pic`` share, from local features to the loss sum.

One call, on every rank of a classifier group::

    features [views * b, D] --normalise--> gradient scaled --> all-gather (backward: reduce-scatter)
        --> x [ranks * views * b, D] vs this rank's rows of W --> kernel (+ its term, if any)
        --> sum over valid columns of (loss + term.weight * term)

What differs between the methods stays with them: which rows are scored (all of a shard, or
PIC's sampled ones), where each column's targets are, how the rows are updated, and what the
sum is divided by.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce, sharded_cosine_ce_with_term
from trainer.classifier.kernel.losses import sum_over_valid
from trainer.classifier.terms.chunk_term import ChunkTerm
from trainer.parallel.collectives import CommTimer, Group, all_gather_rows_with_grad, scale_grad


class CosineHead:
    """``settings``: the kernel's; ``group``: the classifier group (None: one rank holds every row);
    ``feature_grad_scale``: what the features' gradient is multiplied by (the group size when the
    backbone's gradients are then averaged over every rank, so that the average is exact);
    ``term``: an extra per-sample term fused into the kernel's pass (None: the plain loss)."""

    def __init__(self, settings: KernelSettings, group: Group, feature_grad_scale: int, term: ChunkTerm | None,
                 comm_timer: CommTimer) -> None:
        self.settings, self.group, self.term = settings, group, term
        self.feature_grad_scale, self.comm_timer = feature_grad_scale, comm_timer

    def gather(self, features: torch.Tensor) -> torch.Tensor:
        """This rank's ``[views * b, D]`` head outputs -> the group's ``[ranks * views * b, D]`` unit vectors."""
        features = scale_grad(F.normalize(features, dim=1), self.feature_grad_scale)
        return all_gather_rows_with_grad(features, self.group, self.comm_timer)

    def loss_sum(self, features: torch.Tensor, weight: torch.Tensor, target_cols: torch.Tensor,
                 target_weights: torch.Tensor, valid: torch.Tensor, rows=None, update_in_backward=None,
                 check: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 padding_may_be_infinite: bool = False) -> torch.Tensor:
        """``sum over valid columns of (loss + term.weight * term)`` of the group's batch.

        ``features``: this rank's un-normalised ``[views * b, D]``; ``weight``, ``target_cols``,
        ``target_weights``, ``rows``, ``update_in_backward``: as in ``sharded_cosine_ce``, over the
        gathered columns; ``valid``: ``[B]`` of the gathered columns; ``check``: applied to the
        per-sample loss before the sum (e.g. NaN where an id was out of range).

        A padding column (``valid`` False) adds nothing.  When every column scores its own row,
        a non-finite value there is a fault the sum must show (a product with the mask keeps
        the NaN for the trainer's watch); ``padding_may_be_infinite``: a sampled softmax may
        leave a padding column without its row (an infinite loss), so the sum drops it instead
        (``sum_over_valid``)."""
        total = sum_over_valid if padding_may_be_infinite else _masked_sum
        gathered = self.gather(features)
        common = (gathered, weight, target_cols, target_weights, self.settings)
        if self.term is None:
            per_sample = sharded_cosine_ce(*common, self.group, self.comm_timer, rows, update_in_backward)
            term_sum = 0.0
        else:
            per_sample, values = sharded_cosine_ce_with_term(*common, self.term, self.group, self.comm_timer, rows,
                                                             update_in_backward)
            term_sum = self.term.weight * total(values, valid)
        if check is not None:
            per_sample = check(per_sample)
        return total(per_sample, valid) + term_sum


def _masked_sum(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``sum(valid * values)``: equal to ``sum_over_valid`` for finite values, NaN if any is not."""
    return (values * valid.to(values.dtype)).sum()
