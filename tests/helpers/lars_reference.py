"""LARS written straight from apex's LARC (scaling form, ``clip=False``) around torch's SGD with
momentum, one whole tensor at a time, in whatever dtype it is given (float64 in the tests).  It
shares no code with ``trainer.optim`` so it can catch mistakes there, e.g. norms of pieces."""

from __future__ import annotations

import torch


@torch.no_grad()
def larc_sgd_step(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor | None],
                  lr: float, momentum: float, weight_decays: list[float], adapted: list[bool],
                  trust_coefficient: float, eps: float = 1e-8) -> list[torch.Tensor]:
    """One step in place on ``params``; returns the momentum buffers (None: first step)."""
    new_buffers = []
    for param, grad, buffer, weight_decay, adapt in zip(params, grads, buffers, weight_decays, adapted):
        grad = grad.clone()
        if adapt:
            param_norm, grad_norm = torch.norm(param), torch.norm(grad)
            if param_norm != 0 and grad_norm != 0:  # LARC skips decay and scaling otherwise
                adaptive_lr = trust_coefficient * param_norm / (grad_norm + param_norm * weight_decay + eps)
                grad += weight_decay * param
                grad *= adaptive_lr
        elif weight_decay:
            grad += weight_decay * param
        buffer = grad.clone() if buffer is None else buffer.mul_(momentum).add_(grad)  # torch's SGD
        param.sub_(lr * buffer)
        new_buffers.append(buffer)
    return new_buffers
