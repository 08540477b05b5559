"""SGD with momentum: torch's, on its foreach kernels (one launch per op for a whole param group,
where the per-tensor loop launches one per tensor: torch's default on CUDA, asked for on every
device so that the step is the same everywhere), plus the conditional step.  The recipe of
One-Million-Way and PIC (momentum 0.9, weight decay 1e-4 on every parameter)."""

from __future__ import annotations

import torch

from trainer.optim.conditional import ConditionalStep, momentum_step, select_
from trainer.optim.registry import OptimizerSettings, OptimizerSpec


class SGD(ConditionalStep, torch.optim.SGD):
    """torch's SGD (no dampening, no Nesterov) whose ``step`` also takes ``apply``."""

    def initial_state(self, tensor: torch.Tensor, group: dict) -> dict:
        """The state a first step creates (zero momentum, which the first step turns into the
        gradient exactly, as torch's copy of it does), made before it: a checkpoint loads into it."""
        return {"momentum_buffer": torch.zeros_like(tensor)} if group["momentum"] else {}

    @torch.no_grad()
    def step(self, closure=None, apply: torch.Tensor | None = None):
        apply = self._condition(apply)
        if apply is None:
            return super().step(closure)
        loss = self._evaluate(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if group["weight_decay"]:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            if not group["momentum"]:
                for param, grad in zip(params, grads):
                    select_(param, param - group["lr"] * grad, apply)
                continue
            momentum_step(params, grads, self._momentum_buffers(params, group), group["lr"], group["momentum"], apply)
        return loss


def build(groups: list[dict], settings: OptimizerSettings, lr: float, device: torch.device) -> SGD:
    return SGD(groups, lr=lr, momentum=settings.momentum, weight_decay=settings.weight_decay, foreach=True)


SPEC = OptimizerSpec(name="sgd", build=build, state_bytes_per_parameter=4, excludes_by_default=False,
                     reads=frozenset({"momentum"}))
