"""SGD for the classifier shard applied *inside* the backward, chunk by chunk.

The weight gradient of a class shard is as large as the shard itself.  When nothing has to be
averaged across ranks (DHP with a single classifier group) each chunk's gradient can be applied
the moment it is computed, so the full gradient never exists: the shard costs W + momentum
instead of W + gradient + momentum (7.3 GB instead of 10.9 GB per rank for a 14.2M x 128 shard
split over 2 ranks).  The arithmetic is torch.optim.SGD's (no dampening, no Nesterov)::

    g = grad + weight_decay * w;   buf = momentum * buf + g;   w -= lr * buf

It is an ``Optimizer`` so schedules (``param_groups[0]["lr"]``) and checkpoints
(``state[w]["momentum_buffer"]``) treat it like any other; ``step()`` has nothing left to do.
"""

from __future__ import annotations

import torch

from trainer.classifier.kernel.row_adds import add_rows


class InBackwardSGD(torch.optim.Optimizer):
    def __init__(self, weight: torch.nn.Parameter, lr: float, momentum: float = 0.9, weight_decay: float = 0.0) -> None:
        super().__init__([weight], dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.weight = weight

    @torch.no_grad()
    def apply_rows(self, rows: slice | torch.Tensor, grad_rows: torch.Tensor) -> None:
        """Update ``rows`` of the weight (a slice, or distinct int64 indices of sampled rows) with
        their gradient; ``grad_rows`` is modified in place."""
        settings = self.param_groups[0]
        weight = self.weight.data
        if settings["weight_decay"]:
            grad_rows.add_(weight[rows], alpha=settings["weight_decay"])
        state = self.state[self.weight]
        if settings["momentum"]:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(weight)
            buffer = state["momentum_buffer"]
            # A slice is a view updated in place; indexed rows are a copy, written back after.
            rows_buffer = buffer[rows].mul_(settings["momentum"]).add_(grad_rows)
            if not isinstance(rows, slice):
                buffer.index_copy_(0, rows, rows_buffer)
            grad_rows = rows_buffer
        if isinstance(rows, slice):
            weight[rows].sub_(grad_rows, alpha=settings["lr"])
        else:
            add_rows(weight, rows, grad_rows, alpha=-settings["lr"])  # deterministic on CUDA too

    def step(self, closure=None):
        """Nothing to do: the backward pass already applied the update."""
        return None if closure is None else closure()
