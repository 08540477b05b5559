"""The conditional step: an update applied or not by a flag on the device, never read on the host.

Every registered optimizer steps with ``step(closure=None, apply=None)``.  ``apply`` is a 0-dim
bool tensor on the parameters' device: True steps as usual; False leaves the weights and every
state tensor (momentum, moments, AdamW's step counter) exactly as they were, non-finite gradients
included.  The new values are computed and ``torch.where``-selected (a product with the flag
would let a NaN through), so no flag is read on the host.  DeepSpeed calls ``step()`` with no
arguments: ``set_step_condition(flag)`` makes every later step take ``flag`` until it is set back
to None.
"""

from __future__ import annotations

import torch


class ConditionalStep:
    """The part of the optimizer interface that takes the flag (a mixin of the registered ones)."""

    step_condition: torch.Tensor | None = None

    def set_step_condition(self, apply: torch.Tensor | None) -> None:
        """Steps from now on are applied where ``apply`` (0-dim bool, on the device) is True; None:
        always (the default)."""
        if apply is not None and (apply.dtype != torch.bool or apply.dim() != 0):
            raise ValueError(f"a step condition is a 0-dim bool tensor, not {apply.dtype} of shape "
                             f"{tuple(apply.shape)}")
        self.step_condition = apply

    def _condition(self, apply: torch.Tensor | None) -> torch.Tensor | None:
        return apply if apply is not None else self.step_condition

    @staticmethod
    def _evaluate(closure):
        """The closure's loss, computed with gradients enabled (as torch's optimizers do), or None."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _momentum_buffers(self, params: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Each parameter's momentum buffer, made by ``initial_state`` before its first step."""
        buffers = []
        for param in params:
            state = self.state[param]
            if state.get("momentum_buffer") is None:
                state.update(self.initial_state(param, group))
            buffers.append(state["momentum_buffer"])
        return buffers


def select_(target: torch.Tensor, new: torch.Tensor, apply: torch.Tensor) -> None:
    """``target`` becomes ``new`` where ``apply`` is True and stays itself where it is False."""
    target.copy_(torch.where(apply, new, target))


def momentum_step(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor], lr: float,
                  momentum: float, apply: torch.Tensor | None) -> None:
    """``buf <- momentum * buf + grad; param <- param - lr * buf`` on every tensor (torch's SGD
    without dampening or Nesterov, its buffer starting at zero); nothing changes where ``apply``
    is False."""
    if apply is None:
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, grads)
        torch._foreach_add_(params, buffers, alpha=-lr)
        return
    for param, grad, buffer in zip(params, grads, buffers):
        select_(buffer, buffer * momentum + grad, apply)
        select_(param, param - lr * buffer, apply)
