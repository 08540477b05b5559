"""LARS as SwAV trains with it: apex's LARC in its scaling form (``clip=False``) around SGD with
momentum, exact under every ZeRO stage.

For each tensor w of an adapted group, with gradient g, weight decay wd, trust coefficient t:

    if |w| > 0 and |g| > 0:  g <- t |w| / (|g| + wd |w| + eps) * (g + wd w)
    else:                    g unchanged, and no weight decay (LARC skips both)
    buf <- momentum buf + g;  w <- w - lr buf

The trust ratio scales the gradient plus decay before the momentum, and multiplies the learning
rate (the clipping form would take min(ratio / lr, 1) instead; SwAV's code wraps SGD over all
parameters in ``LARC(trust_coefficient=0.001, clip=False)``).  A group with ``adapt`` False (the
no-decay group of ``optim.exclude_from_decay``) is plain SGD with momentum and its own decay.

|w| and |g| are norms of whole tensors.  Under ZeRO, DeepSpeed hands the optimizer flat
partitions that cut across tensors (stages 1-2) or a piece of every tensor (stage 3); after
``use_partitions`` (``trainer.engine.deepspeed_setup`` calls it) each flat partition's norms are
summed over its ranks' pieces with one all-reduce of a [tensors, 2] vector on the device
(``tensor_norms.py``), so every stage steps the same weights as one process would.
"""

from __future__ import annotations

import torch

from trainer.optim.conditional import ConditionalStep, momentum_step
from trainer.optim.partitions import FlatPartition
from trainer.optim.registry import OptimizerSettings, OptimizerSpec
from trainer.optim.tensor_norms import per_element, squared_norms, whole_squared_norms


def trust_factors(weight_norm: torch.Tensor, grad_norm: torch.Tensor, weight_decay: float, trust_coefficient: float,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor (scale, decay) with new gradient = scale * g + decay * w (LARC, clip=False)."""
    adapted = (weight_norm > 0) & (grad_norm > 0)
    ratio = trust_coefficient * weight_norm / (grad_norm + weight_decay * weight_norm + eps)
    scale = torch.where(adapted, ratio, torch.ones_like(ratio))
    decay = torch.where(adapted, ratio * weight_decay, torch.zeros_like(ratio))
    return scale, decay


class LARS(ConditionalStep, torch.optim.Optimizer):
    """Param groups may set ``adapt`` (default True) besides lr, momentum and weight_decay.  The
    gradients of adapted tensors are scaled in place, as LARC does."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8) -> None:
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or trust_coefficient <= 0 or eps < 0:
            raise ValueError(f"invalid LARS settings: lr={lr}, momentum={momentum}, weight_decay={weight_decay}, "
                             f"trust_coefficient={trust_coefficient}, eps={eps}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, adapt=True)
        super().__init__(params, defaults)
        self._built_with = {id(p) for group in self.param_groups for p in group["params"]}
        self._partitions: dict[torch.Tensor, FlatPartition] = {}

    def use_partitions(self, partitions: list[FlatPartition]) -> None:
        """The flat tensors DeepSpeed put in place of the parameters, with their pieces of each
        tensor (``trainer.optim.partitions.optimizer_partitions``)."""
        self._partitions = {partition.tensor: partition for partition in partitions}

    def initial_state(self, tensor: torch.Tensor, group: dict) -> dict:
        """The state a first step creates, made before it (a checkpoint loads into it)."""
        return {"momentum_buffer": torch.zeros_like(tensor)}

    def _adapt_whole(self, params: list[torch.Tensor], grads: list[torch.Tensor], group: dict) -> None:
        if not params:
            return
        scale, decay = trust_factors(squared_norms(params).sqrt(), squared_norms(grads).sqrt(),
                                     group["weight_decay"], group["trust_coefficient"], group["eps"])
        scale, decay = scale.to(params[0].dtype), decay.to(params[0].dtype)
        torch._foreach_mul_(grads, list(scale.unbind()))
        torch._foreach_add_(grads, torch._foreach_mul(params, list(decay.unbind())))

    def _adapt_partition(self, flat: torch.Tensor, partition: FlatPartition, group: dict) -> None:
        sums = whole_squared_norms(partition, flat, flat.grad)
        scale, decay = trust_factors(sums[:, 0].sqrt(), sums[:, 1].sqrt(), group["weight_decay"],
                                     group["trust_coefficient"], group["eps"])
        flat.grad.mul_(per_element(partition, scale, 1.0).to(flat.dtype))
        flat.grad.addcmul_(flat, per_element(partition, decay, 0.0).to(flat.dtype))

    @torch.no_grad()
    def step(self, closure=None, apply: torch.Tensor | None = None):
        apply = self._condition(apply)
        loss = self._evaluate(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["adapt"]:
                whole = []
                for param in params:
                    if param in self._partitions:
                        self._adapt_partition(param, self._partitions[param], group)
                    elif id(param) in self._built_with:
                        whole.append(param)
                    else:
                        raise RuntimeError("LARS was handed a tensor it was not built with and has no partition map "
                                           "for (DeepSpeed's flat partition?): call use_partitions(optimizer_"
                                           "partitions(engine.optimizer)) after deepspeed.initialize, or its trust "
                                           "ratios would come from pieces of tensors")
                self._adapt_whole(whole, [p.grad for p in whole], group)
                grads = [p.grad for p in params]
            elif group["weight_decay"]:
                grads = torch._foreach_add([p.grad for p in params], params, alpha=group["weight_decay"])
            else:
                grads = [p.grad for p in params]
            momentum_step(params, grads, self._momentum_buffers(params, group), group["lr"], group["momentum"], apply)
        return loss


def build(groups: list[dict], settings: OptimizerSettings, lr: float, device: torch.device) -> LARS:
    return LARS(groups, lr=lr, momentum=settings.momentum, weight_decay=settings.weight_decay,
                trust_coefficient=settings.trust_coefficient, eps=settings.eps)


SPEC = OptimizerSpec(name="lars", build=build, state_bytes_per_parameter=4, excludes_by_default=True,
                     reads=frozenset({"momentum", "trust_coefficient", "eps"}))
