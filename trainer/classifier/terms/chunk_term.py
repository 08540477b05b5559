"""The protocol of a per-sample loss term computed inside the sharded kernel's chunk loop.

The kernel (``trainer.classifier.kernel.chunked``) visits every scored row once per pass, a chunk of rows
at a time, and reduces per-sample columns over the classifier group with one MAX and one SUM
all-reduce.  A term that needs statistics over the same rows (a distribution over the negatives,
an entropy, a margin) rides along instead of running its own pass and collectives:

* forward: for each chunk, ``add_chunk`` reads the chunk's base-2 logits ``[rows, B]`` and
  accumulates its own per-sample sums.  It also returns the kernel's own ``sum_j exp2(z)``, so a
  term that exponentiates the logits anyway does it once: one read of the chunk serves both;
  ``columns()`` hands its sums to the kernel's SUM all-reduce (more columns, not more
  collectives); ``finish`` turns the group sums into the per-sample term ``[B]``;
* backward: for each chunk, ``grad_logits`` writes the chunk's whole ``dL/dz`` before the targets'
  part: the kernel's softmax part ``exp2(z - shift)`` plus the term's own.

The kernel never knows which term it runs.  A term decides how its values join the loss through
``weight``: the loss sums ``valid * (loss + weight * term)`` over the columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trainer.classifier.kernel.reductions import SampleColumns


@dataclass(frozen=True)
class KernelPass:
    """What a term may know of one pass of the kernel.

    Attributes:
        batch: B, columns of the pass (the group's samples in all-gather order).
        ranks: ranks of the classifier group (the all-gather's leading factor of B).
        temperature: the kernel's tau; the logits handed to a term are ``z * log2(e)``, ``z = cos / tau``.
        chunks: chunks of the pass, in order (``chunk`` arguments count from 0).
        own_chunk: ``[B]`` the chunk holding each column's own row (its first target), -1 if none here.
        own_row: ``[B]`` that row's index inside its chunk (meaningless where ``own_chunk`` is -1).
        rows_vary: the scored rows are sampled afresh each step (PIC), so the chunks' row counts
            change from step to step (a compiled term would otherwise recompile for each).
    """

    batch: int
    ranks: int
    temperature: float
    chunks: int
    own_chunk: torch.Tensor
    own_row: torch.Tensor
    rows_vary: bool = False


class TermForward(Protocol):
    def add_chunk(self, kernel_sum: torch.Tensor, logits: torch.Tensor, chunk: int) -> torch.Tensor:
        """Accumulate the term's sums of one chunk (``logits`` ``[rows, B]``, base 2, left unchanged)
        and return ``kernel_sum`` ``[B]`` plus the chunk's ``sum_j exp2(logits)``."""
        ...

    def columns(self) -> SampleColumns:
        """The term's per-sample sums, to be reduced over the group with the kernel's."""
        ...

    def finish(self, reduced: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """``(term [B], what the backward needs)`` from the group-reduced columns."""
        ...


class TermBackward(Protocol):
    def grad_logits(self, logits: torch.Tensor, chunk: int) -> torch.Tensor:
        """The chunk's ``dL/dz`` ``[rows, B]`` before the targets' part: ``exp2(logits - shift)``
        plus the term's, from the chunk's unshifted base-2 logits (left unchanged)."""
        ...


class ChunkTerm(Protocol):
    """A per-sample term fused into the kernel's pass; see the module docstring."""

    weight: float  # the loss sums valid * (loss + weight * term)

    def start_forward(self, kernel_pass: KernelPass) -> TermForward:
        ...

    def start_backward(self, kernel_pass: KernelPass, saved: Any, grad_term: torch.Tensor,
                       column_signs: torch.Tensor, shift_base2: torch.Tensor) -> TermBackward:
        """``grad_term``: ``[B]`` upstream gradient of the term; ``column_signs``: ``[B]`` +-1 the
        kernel multiplies whole columns by after its loop (undo them in the term's part);
        ``shift_base2``: ``[B]`` the kernel's softmax shift (``+inf`` zeroes a padding column)."""
        ...
