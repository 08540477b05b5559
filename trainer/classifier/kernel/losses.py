"""The two label-smoothed cosine-softmax losses, as functions of per-sample statistics.

Targets are given per sample as K+1 scored rows (the instance, then K hard negatives) with
weights ``y`` (``1 - alpha`` and ``alpha / K``).  Two forms (``SmoothingForm``):

* ``paper`` - Eq. 3 of the paper, the weights sit *inside* the log:
  ``L_i = -log( sum_j y_ij exp(z_ij) / sum_j exp(z_ij) )``.
* ``soft_target`` - the usual label-smoothed cross entropy, weights *outside* the log:
  ``L_i = -sum_j y_ij log softmax(z_i)_j``.

With ``alpha = 0`` (one target of weight 1) both are ``F.cross_entropy``.

A form never sees the ``[B, N]`` logits.  It names the per-sample columns it needs combined over
ranks (``local_columns``), and from their group values computes the loss and ``LogitGradient``:
the coefficients of ``dL_i/dz_ij = softmax_scale_i * exp(z_ij - log_normalizer_i) - target_coef_ik``
(the last term only where row j is target k), which the chunked backward applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch

from trainer.classifier.kernel.reductions import SampleColumns

LOG_NORMALIZER = "log_normalizer"  # the column every form shares: log sum_j exp(z_ij) over all rows


class SmoothingForm(str, Enum):
    PAPER = "paper"
    SOFT_TARGET = "soft_target"


@dataclass(frozen=True)
class Targets:
    """This rank's view of the K+1 targets of every sample."""

    logits: torch.Tensor  # [B, K+1] fp32 z of each owned target, 0 where not owned
    owned: torch.Tensor  # [B, K+1] bool: the target's row is scored on this rank
    weights: torch.Tensor  # [B, K+1] fp32 y, the same on every rank


@dataclass(frozen=True)
class LogitGradient:
    """``dL_i/dz_ij = softmax_scale_i * exp(z_ij - log_normalizer_i) - target_coef_ik``."""

    softmax_scale: torch.Tensor  # [B]
    log_normalizer: torch.Tensor  # [B] log sum_j exp(z_ij) over all rows of all ranks
    target_coef: torch.Tensor  # [B, K+1], 0 where the target is not owned


def sum_over_valid(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The sum of per-sample ``values`` where ``valid`` (0/1 or bool) is set.  A ``where``, not a
    product with the mask: a padding repeat whose own row the step does not score (PIC's sampled
    softmax) has no target and an infinite loss, and inf * 0 is NaN.  Its gradient is 0 either way."""
    return torch.where(valid.bool(), values, torch.zeros_like(values)).sum()


def _paper_columns(targets: Targets) -> SampleColumns:
    # log sum_k y_k exp(z_k) over the owned targets; -inf where none is owned (or all have y = 0).
    weighted = torch.where(targets.owned, targets.weights * torch.exp(targets.logits), 0.0)
    return SampleColumns(logsumexp={"target_logsumexp": torch.log(weighted.sum(dim=1))})


def _paper_finish(targets: Targets, reduced: dict[str, torch.Tensor]) -> tuple[torch.Tensor, LogitGradient]:
    log_normalizer, target_lse = reduced[LOG_NORMALIZER], reduced["target_logsumexp"]
    # dL/dz_ij = p_ij - q_ij with q = y exp(z) renormalised over the targets of all ranks.
    target_coef = torch.where(
        targets.owned, targets.weights * torch.exp(targets.logits - target_lse[:, None]), 0.0
    )
    gradient = LogitGradient(torch.ones_like(log_normalizer), log_normalizer, target_coef)
    return log_normalizer - target_lse, gradient


def _soft_target_columns(targets: Targets) -> SampleColumns:
    return SampleColumns(sums={"target_dot": torch.where(targets.owned, targets.weights * targets.logits, 0.0).sum(1)})


def _soft_target_finish(targets: Targets, reduced: dict[str, torch.Tensor]) -> tuple[torch.Tensor, LogitGradient]:
    log_normalizer = reduced[LOG_NORMALIZER]
    weight_total = targets.weights.sum(dim=1)
    # dL/dz_ij = (sum_k y_ik) p_ij - y_ij.
    gradient = LogitGradient(weight_total, log_normalizer, torch.where(targets.owned, targets.weights, 0.0))
    return weight_total * log_normalizer - reduced["target_dot"], gradient


@dataclass(frozen=True)
class LossForm:
    local_columns: Callable[[Targets], SampleColumns]
    finish: Callable[[Targets, dict[str, torch.Tensor]], tuple[torch.Tensor, LogitGradient]]


LOSS_FORMS = {
    SmoothingForm.PAPER: LossForm(_paper_columns, _paper_finish),
    SmoothingForm.SOFT_TARGET: LossForm(_soft_target_columns, _soft_target_finish),
}
