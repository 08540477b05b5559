"""``optim.on_nonfinite: skip_step`` decided on the device: no flag is read on the host per step.

After the backward, one flag says whether the step is kept: every rank's loss and every gradient
finite (the backbone's, averaged over the ranks, and the objective's rows), agreed with one
all-reduce of one number on the device.  The flag then travels to everything the step changes:

- the backbone's optimizer steps conditionally (``trainer.optim.conditional``: a dropped step leaves
  weights and momentum exactly as they were);
- the objective's optimizers take it too: torch's fused optimizers as ``found_inf`` (their kernels
  skip the update, momentum included), the registry's as a step condition;
- BatchNorm's running statistics, which the forward already moved, are put back where it says
  (``torch.where`` from ``StepSkipper.before_forward``'s copy).

Counters on the device (steps dropped since the last look, in a row, the last one) are read on log
steps only: the log event, the metric, and the stop after ``optim.max_skipped_in_a_row`` come then.

It needs whole gradients on every rank before the step and an objective whose per-step state is only
what its optimizers step (``Objective.skips_on_device``): ZeRO stage 0 (the shipped GPU configs) with
``instance``.  Otherwise the trainer agrees before the backward, blocking (``step_skipping``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from trainer.engine.gradient_watch import GradientWatch, all_finite
from trainer.engine.stop_conditions import NonFiniteLossError, what_to_do_after_nonfinite
from trainer.optim import ConditionalStep


def _condition(optimizer: torch.optim.Optimizer, apply: torch.Tensor | None) -> None:
    """Tell ``optimizer`` to step only where ``apply`` (None: always)."""
    if isinstance(optimizer, ConditionalStep):
        optimizer.set_step_condition(apply)
    elif all(group.get("fused") for group in optimizer.param_groups):
        # torch's fused kernels skip the whole update (momentum included) where found_inf is non-zero
        optimizer.found_inf = None if apply is None else (~apply).float()
    else:
        raise ValueError(f"{type(optimizer).__name__} can neither step on a condition nor take found_inf: "
                         "use optim.on_nonfinite: stop, or an objective whose optimizers are fused")


def _create_momentum(optimizer: torch.optim.Optimizer) -> None:
    """torch's fused SGD makes its momentum buffer at the first step and, if that step is skipped by
    ``found_inf``, leaves it unwritten: make it first (zero, which the first update turns into the
    gradient exactly, as torch's copy of it would)."""
    for group in optimizer.param_groups:
        if group.get("momentum"):
            for param in group["params"]:
                state = optimizer.state[param]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)


class DeviceStepSkipper:
    """``module``: the engine's network; ``backbone_optimizer``: the optimizer DeepSpeed steps
    (unwrapped at stage 0); ``objective``: its ``optimizers()`` follow the flag."""

    def __init__(self, module: torch.nn.Module, backbone_optimizer, objective, group, device: torch.device,
                 max_in_a_row: int, metrics, log, say: Callable[[str], None]) -> None:
        self.module, self.backbone_optimizer, self.objective, self.group = module, backbone_optimizer, objective, group
        self.max_in_a_row, self.metrics, self.log, self.say = max_in_a_row, metrics, log, say
        self.step = torch.zeros((), dtype=torch.int64, device=device)  # counted on the device
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # since the last look
        self.in_a_row = torch.zeros((), dtype=torch.int64, device=device)
        self.last_skipped = torch.zeros((), dtype=torch.int64, device=device)
        for optimizer in objective.optimizers():
            _create_momentum(optimizer)

    def start_at(self, step: int) -> None:
        self.step.fill_(step)

    def decide(self, loss: torch.Tensor) -> torch.Tensor:
        """After the backward, before any optimizer steps: the agreed flag (0-dim bool, True: keep the
        step), handed to every optimizer of the step."""
        gradients = [p.grad for p in self.module.parameters() if p.grad is not None]
        gradients += [p.grad for optimizer in self.objective.optimizers() for group in optimizer.param_groups
                      for p in group["params"] if p.grad is not None]
        keep = torch.isfinite(loss.detach()).all()
        if gradients:
            keep = keep & all_finite(gradients)
        bad = (~keep).to(torch.int32).reshape(1)
        if self.group is not None:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)  # on the device: nothing waits
        apply = bad[0] == 0
        _condition(self.backbone_optimizer, apply)
        for optimizer in self.objective.optimizers():
            _condition(optimizer, apply)
        return apply

    @torch.no_grad()
    def after_step(self, apply: torch.Tensor, buffers: list[torch.Tensor]) -> None:
        """Put the statistics back where the step was dropped; count it; the optimizers step
        unconditionally again."""
        for buffer, before in zip(self.module.buffers(), buffers):
            buffer.copy_(torch.where(apply, buffer, before))
        self.step += 1
        dropped = (~apply).to(torch.int64)
        self.skipped += dropped
        self.in_a_row = torch.where(apply, torch.zeros_like(self.in_a_row), self.in_a_row + 1)
        self.last_skipped = torch.where(apply, self.last_skipped, self.step)
        _condition(self.backbone_optimizer, None)
        for optimizer in self.objective.optimizers():
            _condition(optimizer, None)

    def check(self, step: int, last_checkpoint: Path | None) -> None:
        """On a log step (one read): log and count the steps dropped since the last look; stop after
        ``max_in_a_row`` in a row."""
        skipped, in_a_row, last = torch.stack([self.skipped, self.in_a_row, self.last_skipped]).tolist()
        if not skipped:
            return
        self.skipped.zero_()
        self.metrics.nonfinite_skipped.inc(skipped)
        self.log.write(event="nonfinite_step_skipped", step=last, skipped=skipped, in_a_row=in_a_row)
        self.say(f"step {last}: a rank's loss or gradient was NaN or inf; the step was skipped on every rank "
                 f"({skipped} skipped since the last log step, {in_a_row} in a row)")
        if in_a_row >= self.max_in_a_row:
            raise NonFiniteLossError(
                f"{in_a_row} steps in a row up to step {last} had a NaN or inf loss or gradient "
                f"(optim.max_skipped_in_a_row={self.max_in_a_row}): the model, not a batch, has gone bad. "
                f"{what_to_do_after_nonfinite(last_checkpoint)}")


def nonfinite_guards(engine, backbone_optimizer, objective, skip_nonfinite: bool, max_skipped_in_a_row: int, dims,
                     metrics, log, say, one_rank_collectives: bool = False
                     ) -> tuple[DeviceStepSkipper | None, GradientWatch | None]:
    """``(device_skip, gradient_watch)``, one of them set: ``skip_step`` decided on the device where the
    gradients are whole on every rank before the step and the objective allows it (ZeRO stage 0);
    else the watch of the gradients DeepSpeed hands the optimizer it wraps, whatever the ZeRO stage
    (the device skip checks the same gradients itself, before the step).  ``one_rank_collectives``:
    the device skip agrees over the default group in a one-rank job too (a one-GPU check)."""
    stepped_by_deepspeed = getattr(backbone_optimizer, "optimizer", backbone_optimizer)  # unwrapped
    if skip_nonfinite and objective.skips_on_device and engine.zero_optimization_stage() == 0:
        group = dims.data_parallel_group
        if group is None and one_rank_collectives and dist.is_initialized():
            group = dist.group.WORLD
        return DeviceStepSkipper(engine.module, stepped_by_deepspeed, objective, group, dims.device,
                                 max_skipped_in_a_row, metrics, log, say), None
    return None, GradientWatch(stepped_by_deepspeed, dims.device)
