"""``optim.on_nonfinite: skip_step``: dropping a step whose loss is NaN or inf on some rank.

Every rank drops the step together (the trainer agrees on it before the backward): nothing is
backpropagated or stepped, and what the forward already changed is put back.  Too many dropped
steps in a row mean the model, not a batch, has gone bad, and the run stops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from trainer.engine.stop_conditions import NonFiniteLossError, what_to_do_after_nonfinite


class StepSkipper:
    """``module``: the engine's network, whose BatchNorm statistics the forward changes;
    ``objective``: told to undo its own changes (``Objective.skip_step``)."""

    def __init__(self, module: torch.nn.Module, objective, max_in_a_row: int, metrics, log, say: Callable[[str], None]):
        self.module, self.objective, self.max_in_a_row = module, objective, max_in_a_row
        self.metrics, self.log, self.say = metrics, log, say
        self.in_a_row = 0

    def before_forward(self) -> list[torch.Tensor]:
        """BatchNorm's running statistics change in the forward: a copy (kilobytes) to put back
        if the step is dropped, since one NaN batch would make them NaN for good."""
        return [buffer.clone() for buffer in self.module.buffers()]

    def kept(self) -> None:
        self.in_a_row = 0

    def skip(self, buffers: list[torch.Tensor], step: int, last_checkpoint: Path | None) -> None:
        """Drop ``step`` (1-based): put the buffers back, let the objective undo its part, count it."""
        with torch.no_grad():
            for buffer, before in zip(self.module.buffers(), buffers):
                buffer.copy_(before)
        self.objective.skip_step()
        self.in_a_row += 1
        self.metrics.nonfinite_skipped.inc()
        self.log.write(event="nonfinite_step_skipped", step=step, in_a_row=self.in_a_row)
        self.say(f"step {step}: a rank's loss was NaN or inf; the step was skipped on every rank "
                 f"({self.in_a_row} in a row)")
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteLossError(
                f"{self.in_a_row} steps in a row up to step {step} had a NaN or inf loss "
                f"(optim.max_skipped_in_a_row={self.max_in_a_row}): the model, not a batch, has "
                f"gone bad. {what_to_do_after_nonfinite(last_checkpoint)}")
