"""Stopping cleanly: SIGTERM (Kubernetes preemption) and non-finite losses.

The SIGTERM handler only sets a flag.  All ranks agree on it through one tiny all-reduce per step
on the gloo control group (a CPU tensor, so no GPU sync), then save and exit ``PREEMPTED`` (143,
``trainer.exit_codes``: retryable).  That all-reduce is
off the step's critical path: ``stop_after_step`` starts this step's reduction without waiting
(``async_op``) and reads the one started a step earlier, long finished by then.  Every rank reads
the same reduced flag at the same step, so all stop after the same step; a SIGTERM simply takes
effect one step later than a blocking agreement would give (a step is far shorter than the grace
period).

A non-finite loss or backbone gradient (``trainer.engine.gradient_watch``) is remembered on the
device, with the first step it happened, without a sync, and checked on log steps; before every
checkpoint the parameters are checked too, so a poisoned model is never saved as a good one.
Under ``optim.on_nonfinite: skip_step`` the agreement cannot wait a step: whether any rank's loss is
finite must be known before this step's backward.  There ``agree(loss)`` is a blocking all-reduce
carrying both flags, every step (the price of skip_step), and ``stop_after_step`` is not used.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from trainer.parallel import shutdown_clock


class NonFiniteLossError(RuntimeError):
    pass


class StepAgreement(NamedTuple):
    stop: bool
    nonfinite: bool


class StopSignal:
    def __init__(self, control_group) -> None:
        self._requested = False
        self._control_group = control_group
        self._pending: tuple[dist.Work | None, torch.Tensor] | None = None  # the last step's reduction
        shutdown_clock.shutdown_timeout_s()  # a bad value fails now, not during a stop
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self._requested = True
        shutdown_clock.begin_shutdown()  # the SIGKILL follows after the agent's shutdown timeout

    @property
    def requested(self) -> bool:
        """Whether this rank has had SIGTERM (what the others had is known only after the next agreement)."""
        return self._requested

    def stop_after_step(self) -> bool:
        """Whether every rank stops now, after this step (collective: call once per step on all
        ranks).  True once any rank had SIGTERM by the end of the previous step; never blocks on a
        round trip: the reduction it waits for was started a step ago."""
        stop = False
        if self._pending is not None:
            work, flags = self._pending
            self._pending = None
            if work is not None:
                work.wait()
            stop = bool(flags[0])
        if not stop:  # nothing is left in flight on a stop: the checkpoint's collectives come next
            flags = torch.tensor([int(self._requested)])
            work = None
            if self._control_group is not None:
                work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control_group, async_op=True)
            self._pending = (work, flags)
        return stop

    def settle(self) -> None:
        """Wait for the reduction still in flight (the loop ended without stopping), so that no
        collective outlives the training loop; its flag is dropped (the run is over)."""
        if self._pending is not None and self._pending[0] is not None:
            self._pending[0].wait()
        self._pending = None

    def agree(self, loss: torch.Tensor | None = None) -> StepAgreement:
        """What every rank agrees on this step, blocking (collective: call on all ranks; only
        under skip_step, whose decision cannot be deferred): ``stop``, any rank got SIGTERM; with
        ``loss``, ``nonfinite``, any rank's loss is NaN or inf (reading it waits for the device to
        finish the forward)."""
        flags = torch.tensor([int(self._requested), 0])
        if loss is not None:
            flags[1] = int(not torch.isfinite(loss.detach()).all().item())
        if self._control_group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control_group)
        return StepAgreement(stop=bool(flags[0]), nonfinite=bool(flags[1]))

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


class NonFiniteWatch:
    """Remembers, on the device, whether any loss or backbone gradient since the start was NaN or
    inf, and the first step each went bad; read only by ``check`` (log steps, saves)."""

    NONE = 2**62  # "no such step", larger than any step

    def __init__(self, device: torch.device) -> None:
        self._bad = torch.zeros((), dtype=torch.bool, device=device)
        self._step = torch.zeros((), dtype=torch.int64, device=device)  # counted on the device, never read
        self._first_bad_loss = torch.full((), self.NONE, dtype=torch.int64, device=device)
        self._first_bad_gradient = torch.full((), self.NONE, dtype=torch.int64, device=device)

    def start_at(self, step: int) -> None:
        """The steps done before this run's first (a resume's); the next ``observe`` is step + 1."""
        self._step.fill_(step)

    def observe(self, loss: torch.Tensor, gradients_bad: torch.Tensor | None = None) -> None:
        """One step's loss and, when known, whether its gradients held a NaN or inf (``GradientWatch``)."""
        self._step += 1
        bad_loss = ~torch.isfinite(loss.detach())
        self._first_bad_loss = torch.where(bad_loss, torch.minimum(self._first_bad_loss, self._step),
                                           self._first_bad_loss)
        self._bad |= bad_loss
        if gradients_bad is not None:
            self._first_bad_gradient = torch.where(gradients_bad, torch.minimum(self._first_bad_gradient, self._step),
                                                   self._first_bad_gradient)
            self._bad |= gradients_bad

    def observe_parameters(self, tensors) -> None:
        """Before a save: a finite loss can still be followed by an update that overflowed.  A tensor's
        extremes say it (NaN propagates into both, an infinity is one), read by one reduction:
        ``isfinite`` would build a copy of its absolute values and three masks, 1.75x the size of W
        (550 MiB on a CPU rank of ImageNet-1K on 2 ranks, the peak of every save)."""
        for tensor in tensors:
            if tensor.numel():  # a ZeRO-3 rank's partition may be empty
                low, high = torch.aminmax(tensor.detach())
                self._bad |= ~(torch.isfinite(low) & torch.isfinite(high)).to(self._bad.device)

    def check(self, control_group, step: int, last_good: str | None) -> None:
        """Raise on every rank if any rank saw a non-finite loss, gradient or parameter (collective):
        one read and one all-reduce of three numbers, the first bad steps as their negatives (MAX)."""
        flags = torch.stack([self._bad.to(torch.int64), -self._first_bad_loss, -self._first_bad_gradient]).cpu()
        if control_group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=control_group)
        bad, first_loss, first_gradient = flags.tolist()
        if not bad:
            return
        found = [f"the loss at step {-first_loss}" if -first_loss != self.NONE else "",
                 f"a backbone gradient at step {-first_gradient} (behind a finite loss)"
                 if -first_gradient != self.NONE and -first_gradient < -first_loss else ""]
        what = " and ".join(f for f in found if f) or "the parameters"
        raise NonFiniteLossError(f"the loss or the parameters became NaN or inf by step {step} (first: {what}); "
                                 f"nothing was saved after it. {what_to_do_after_nonfinite(last_good)}")


def what_to_do_after_nonfinite(last_good: str | Path | None) -> str:
    """The end of every non-finite stop's message: where to resume from and what to change first."""
    return (f"Last good checkpoint: {last_good or 'none'}. Lower optim.base_lr, check the data with `instcls "
            "validate-shards` (an instance id outside [0, N) also makes its sample's loss NaN), or use an fp32 "
            "DeepSpeed config, then resume with --resume auto.")
