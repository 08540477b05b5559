"""torch's SGD on the rows a step samples, exact for every other row too.

Dense SGD with a zero gradient still moves a row that was not sampled (weight decay shrinks it,
momentum carries it).  ``LazyRowSGD`` applies those skipped steps only when the row is next read:
each row remembers the step it was last brought up to date, and ``StepTransitions`` gives the exact
float64 product of the skipped steps' matrices, whatever the learning rate did meanwhile.  The
result equals dense ``torch.optim.SGD(momentum=m, weight_decay=wd)`` in which unsampled rows get a
zero gradient (tests hold it to 1e-6 over thousands of skipped steps).

Which rows are where (device, host, disk) is ``WorkingSet``'s business; this class is the
arithmetic, and looks like an optimizer to the trainer: ``param_groups[0]["lr"]`` is set from the
shared schedule and ``step()`` updates the rows the objective marked with ``set_pending``.
"""

from __future__ import annotations

import numpy as np
import torch

from data_pipeline.contract import to_device
from trainer.objectives.pic.skipped_steps_sgd import StepTransitions


class LazyRowSGD:
    def __init__(self, momentum: float, weight_decay: float, step: int = 0) -> None:
        self.momentum, self.weight_decay = momentum, weight_decay
        self.param_groups = [{"lr": 0.0, "params": []}]
        self.transitions = StepTransitions(momentum, weight_decay, base=step)
        self._pending = None
        self.after_step = None  # called with the step just taken (the objective's prefetch)

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    @torch.no_grad()
    def bring_forward(self, weight: torch.Tensor, momentum: torch.Tensor, last: np.ndarray, step: int) -> int:
        """Apply, in place, the steps ``[last_i, step)`` each row skipped; returns how many rows moved
        (callers count them on their own thread: this runs in the prefetch thread too)."""
        stale = np.flatnonzero(last < step)
        if stale.size == 0:
            return 0
        matrices = to_device(self.transitions.between(last[stale], step), weight.device)
        index = to_device(stale, weight.device)
        w, u = weight[index].double(), momentum[index].double()
        weight[index] = (matrices[:, 0, 0, None] * w + matrices[:, 0, 1, None] * u).to(weight.dtype)
        momentum[index] = (matrices[:, 1, 0, None] * w + matrices[:, 1, 1, None] * u).to(momentum.dtype)
        return stale.size

    @torch.no_grad()
    def update(self, weight: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor | None) -> None:
        """torch's SGD step, in place and in torch's order: d = g + wd w; u = m u + d; w = w - lr u."""
        d_p = weight * self.weight_decay if grad is None else grad.to(weight.dtype).add(weight, alpha=self.weight_decay)
        momentum.mul_(self.momentum).add_(d_p)
        weight.add_(momentum, alpha=-self.lr)

    def set_pending(self, weight: torch.Tensor, momentum: torch.Tensor, leaf: torch.Tensor, step: int) -> None:
        """What ``step()`` updates: rows fetched for ``step`` and the leaf the loss was computed from."""
        self._pending = (weight, momentum, leaf, step)

    @property
    def pending_leaf(self) -> torch.Tensor | None:
        """The fp32 rows the pending loss was computed from (their ``.grad`` after backward)."""
        return None if self._pending is None else self._pending[2]

    def step(self) -> None:
        if self._pending is None:
            raise RuntimeError("LazyRowSGD.step() without a loss: the objective must fetch rows first")
        weight, momentum, leaf, step = self._pending
        self._pending = None
        self.update(weight, momentum, leaf.grad)
        self.transitions.push(step, self.lr)
        if self.after_step is not None:
            self.after_step(step)

    def skip(self) -> int:
        """Drop the pending step (a non-finite loss): its rows stay, and the step enters the
        arithmetic of every other row as the identity.  Returns the step."""
        if self._pending is None:
            raise RuntimeError("LazyRowSGD.skip() without a loss: the objective must fetch rows first")
        step = self._pending[3]
        self._pending = None
        self.transitions.push_skipped(step)
        return step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: each step's leaf is new."""
