"""AdamW, for ViTs: torch's, with its fused kernel on every device torch has one for (CUDA and
the CPU), else its foreach kernels.  The learning rate follows the job's schedule (linear warm-up,
cosine decay: ``trainer.engine.schedule``), the decay group's weight decay too when
``optim.weight_decay_end`` is set.  Its state per parameter: the two moments and the step counter
(``step``, which the bias correction reads; a checkpoint carries it like the moments).
"""

from __future__ import annotations

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from trainer.optim.conditional import ConditionalStep
from trainer.optim.registry import OptimizerSettings, OptimizerSpec


def _scalar_dtype(fused: bool) -> torch.dtype:
    """The dtype torch's Adam keeps its step counter in (float32, float64 under a float64 default)."""
    if not fused and torch.get_default_dtype() == torch.float64:
        return torch.float64
    return torch.float32


class AdamW(ConditionalStep, torch.optim.AdamW):
    """torch's AdamW; the conditional step goes through the fused kernel's ``found_inf`` input,
    which leaves weights, moments and the step counter untouched where it is set."""

    def initial_state(self, tensor: torch.Tensor, group: dict) -> dict:
        """The state torch's first step creates, made before it (a checkpoint loads into it)."""
        on_device = group["fused"] or group["capturable"]
        state = {"step": torch.zeros((), dtype=_scalar_dtype(bool(group["fused"])),
                                     device=tensor.device if on_device else "cpu"),
                 "exp_avg": torch.zeros_like(tensor, memory_format=torch.preserve_format),
                 "exp_avg_sq": torch.zeros_like(tensor, memory_format=torch.preserve_format)}
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(tensor, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None, apply: torch.Tensor | None = None):
        apply = self._condition(apply)
        if apply is None:
            return super().step(closure)
        if not all(group["fused"] for group in self.param_groups):
            raise RuntimeError("AdamW's conditional step needs its fused kernel (found_inf); this device has none")
        self.found_inf = (~apply).float()  # read by torch's step, which hands it to the fused kernel
        try:
            return super().step(closure)
        finally:
            del self.found_inf


def build(groups: list[dict], settings: OptimizerSettings, lr: float, device: torch.device) -> AdamW:
    fused = device.type in _get_fused_kernels_supported_devices()
    return AdamW(groups, lr=lr, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay,
                 fused=fused or None, foreach=None if fused else True)


SPEC = OptimizerSpec(name="adamw", build=build, state_bytes_per_parameter=8, excludes_by_default=True,
                     reads=frozenset({"betas", "eps"}))
