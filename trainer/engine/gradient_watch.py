"""Whether the backbone's gradients were finite, found on the device in the optimizer's own step.

DeepSpeed's overflow check and gradient norm read the host every step, so the shipped GPU configs
turn them off (``trainer.engine.deepspeed_host_syncs``).  The check moves here: a step pre-hook on
the optimizer DeepSpeed wraps sees the gradients every ZeRO stage hands it (the whole tensors at
stage 0, this rank's flat partitions at 1-2, its partitions at 3; at 1-2 once per param group) and
folds one norm of each (a foreach kernel) into a flag on the device.  Nothing is read here: the
trainer passes the flag to ``NonFiniteWatch``, which is read on log steps and before saves.  A rank
that sees only its own partition flags only its own part; the check's all-reduce over the ranks
makes it everyone's.  A config whose DeepSpeed optimizer checks for overflow itself drops such a
step before the optimizer runs; the trainer passes that on (``take(dropped_by_deepspeed=True)``).
"""

from __future__ import annotations

import torch


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-dim bool on the tensors' device: no NaN or infinity in any of ``tensors`` (a NaN or an
    infinity anywhere makes its tensor's norm, then the sum, non-finite; one foreach norm, no host
    read)."""
    norms = torch._foreach_norm(tensors)
    return torch.isfinite(torch.stack([norm.float() for norm in norms]).sum())


class GradientWatch:
    """``take()`` after each step: a 0-dim bool on the device, True if any gradient the optimizer
    stepped since the last ``take()`` held a NaN or an infinity."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.device = device
        self._bad = torch.zeros((), dtype=torch.bool, device=device)
        self._handle = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            self._bad = self._bad | ~all_finite(grads).to(self.device)

    def take(self, dropped_by_deepspeed: bool = False) -> torch.Tensor:
        """``dropped_by_deepspeed``: DeepSpeed's own overflow check dropped the step (its
        ``skipped_steps`` grew; only the configs that read the host every step check), so the
        optimizer never saw the gradients: they count as non-finite, not as a silent skip."""
        bad, self._bad = self._bad, torch.zeros((), dtype=torch.bool, device=self.device)
        if dropped_by_deepspeed:
            bad = torch.ones((), dtype=torch.bool, device=self.device)
        return bad

    def remove(self) -> None:
        self._handle.remove()


class PoisonGradient(torch.autograd.Function):
    """Identity forward; the backward makes the incoming gradient infinite: a finite loss with an
    infinite gradient behind it, as an overflow in the backward would give (the fail point
    ``train.inf_gradient``)."""

    @staticmethod
    def forward(ctx, features: torch.Tensor) -> torch.Tensor:
        return features.view_as(features)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")
