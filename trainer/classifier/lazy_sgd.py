"""torch's SGD on the rows of a ``RowStore`` that a step samples, exact for every other row too.

Dense SGD with a zero gradient still moves a row that was not sampled (weight decay shrinks it,
momentum carries it).  ``LazyRowSGD`` applies those skipped steps only when the row is next read:
each row remembers the step it was last brought up to date, and ``StepTransitions`` gives the exact
float64 product of the skipped steps' matrices, whatever the learning rate did meanwhile.  The
result equals dense ``torch.optim.SGD(momentum=m, weight_decay=wd)`` in which unsampled rows get a
zero gradient (a test holds it to 1e-6 over thousands of skipped steps).

Per step: ``fetch(rows, t)`` -> the rows at step t (corrected) on the compute device; the loss and
backward run on them; ``update(rows, weight, momentum, grad, t)`` takes the SGD step with this
step's learning rate, writes them back as current at ``t + 1`` and records step t's matrix.
``materialize(t)`` brings every row to step t (before a checkpoint or anything else reads W whole).
"""

from __future__ import annotations

import numpy as np
import torch

from trainer.classifier.row_store import RowStore
from trainer.classifier.transitions import StepTransitions


class LazyRowSGD:
    """Looks like an optimizer to the trainer (``param_groups[0]["lr"]`` is set from the shared
    schedule, ``step()`` applies the pending update); the objective supplies the pending rows."""

    def __init__(self, store: RowStore, momentum: float, weight_decay: float, step: int = 0) -> None:
        self.store, self.momentum, self.weight_decay = store, momentum, weight_decay
        self.param_groups = [{"lr": 0.0, "params": []}]
        self.transitions = StepTransitions(momentum, weight_decay, base=step)
        self.corrected_rows = 0  # rows brought forward by fetch (a metric)
        self._pending = None
        self.after_step = None  # called with the step just taken (the objective's prefetch)

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    @torch.no_grad()
    def bring_forward(self, weight: torch.Tensor, momentum: torch.Tensor, last: np.ndarray, step: int) -> None:
        """Apply, in place, the steps ``[last_i, step)`` each row skipped."""
        stale = np.flatnonzero(last < step)
        if stale.size == 0:
            return
        self.corrected_rows += stale.size
        matrices = torch.from_numpy(self.transitions.between(last[stale], step)).to(weight.device)
        index = torch.from_numpy(stale).to(weight.device)
        w, u = weight[index].double(), momentum[index].double()
        weight[index] = (matrices[:, 0, 0, None] * w + matrices[:, 0, 1, None] * u).to(weight.dtype)
        momentum[index] = (matrices[:, 1, 0, None] * w + matrices[:, 1, 1, None] * u).to(momentum.dtype)

    def fetch(self, rows: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows`` (int64, CPU) as they are at step ``step``, on the compute device."""
        weight, momentum, last = self.store.read(rows)
        self.bring_forward(weight, momentum, last, step)
        return weight, momentum

    @torch.no_grad()
    def update(self, rows: torch.Tensor, weight: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor | None,
               step: int) -> None:
        """torch's SGD step ``t = step`` on the fetched rows (distinct), then write them back."""
        if grad is not None:  # d_p = g + wd w; u = m u + d_p; w = w - lr u, in torch's order of operations
            d_p = grad.to(weight.dtype).add(weight, alpha=self.weight_decay)
            momentum.mul_(self.momentum).add_(d_p)
        else:
            momentum.mul_(self.momentum).add_(weight, alpha=self.weight_decay)
        weight.add_(momentum, alpha=-self.lr)
        self.store.write(rows, weight, momentum, step + 1)

    def set_pending(self, rows, weight, momentum, leaf: torch.Tensor, step: int) -> None:
        """What ``step()`` will update: the fetched rows and the leaf the loss was computed from."""
        self._pending = (rows, weight, momentum, leaf, step)

    @property
    def pending_leaf(self) -> torch.Tensor | None:
        """The fp32 rows the pending loss was computed from (their ``.grad`` after backward)."""
        return None if self._pending is None else self._pending[3]

    def step(self) -> None:
        if self._pending is None:
            raise RuntimeError("LazyRowSGD.step() without a loss: the objective must fetch rows first")
        rows, weight, momentum, leaf, step = self._pending
        self._pending = None
        self.update(rows, weight, momentum, leaf.grad, step)
        self.transitions.push(step, self.lr)
        if self.after_step is not None:
            self.after_step(step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: each step's leaf is new."""

    @torch.no_grad()
    def materialize(self, step: int) -> None:
        """Bring every row to ``step`` (block by block) and forget the recorded steps."""
        store = self.store
        for block in store.blocks():
            last = store.last_step[block].numpy().astype(np.int64)
            if (last < step).any():
                weight = store.weight[block].to(store.compute_device)
                momentum = store.momentum[block].to(store.compute_device)
                self.bring_forward(weight, momentum, last, step)
                store.weight[block] = weight.to(store.weight.device)
                store.momentum[block] = momentum.to(store.momentum.device)
                store.last_step[block] = step
        self.transitions.reset(step)
