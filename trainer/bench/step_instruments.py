"""Per-phase counts of a run of training steps, for `instcls bench step`: host syncs, dispatched ops
and, on CUDA, kernels.

A run (the job's trainer or the plain baseline) tells ``StepInstruments`` when each step starts and
ends, and its ``StepPhases`` marks go through ``InstrumentedPhases``, so whatever happens between
two marks is the phase's that ends at the second one, exactly as ``StepPhases`` times it.  Counted:

- host syncs (GPU: the sites ``device_sync_sites`` records): every step's, per phase;
- ops (``OpCounter``): one step's, ``count_step``, the counter active only then (its dispatch
  overhead would slow a timed step);
- CUDA kernels (``PhaseKernelProfile``, torch.profiler): one other step's, ``profile_step``.
"""

from __future__ import annotations

from collections import Counter

import torch

from trainer.bench.cuda_kernels import PhaseKernelProfile
from trainer.bench.op_counting import OpCounter


class StepInstruments:
    """Attributes after the run:
    host_syncs: per step, host syncs per phase (empty without ``sync_sites``).
    ops, ops_by_name: per phase, ops of step ``count_step`` (in total, and by op name).
    cuda_kernels: per phase, CUDA kernels of step ``profile_step`` (None when not profiled).
    """

    def __init__(self, count_step: int, profile_step: int | None = None, sync_sites: list[str] | None = None) -> None:
        self.count_step, self.profile_step, self.sync_sites = count_step, profile_step, sync_sites
        self.step = -1
        self.host_syncs: list[dict[str, int]] = []
        self.ops: dict[str, int] = {}
        self.ops_by_name: dict[str, dict[str, int]] = {}
        self.cuda_kernels: dict[str, int] | None = None
        self._counter: OpCounter | None = None
        self._profile: PhaseKernelProfile | None = None
        self._step_syncs: Counter[str] = Counter()
        self._syncs_at_mark = 0

    # -- steps ---------------------------------------------------------------------------

    def step_starts(self) -> None:
        self.step += 1
        self._step_syncs = Counter()
        if self.step == self.count_step:
            self._counter = OpCounter()
            self._counter.__enter__()
        if self.step == self.profile_step:
            self._profile = PhaseKernelProfile()
            self._profile.start()

    def step_ends(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        if self._profile is not None:
            self.cuda_kernels = self._profile.stop()
            self._profile = None
        if self.sync_sites is not None and self.step >= 0:
            self.host_syncs.append(dict(self._step_syncs))

    # -- phase marks (StepPhases') ------------------------------------------------------------

    def _syncs_now(self) -> int:
        return len(self.sync_sites) if self.sync_sites is not None else 0

    def begin(self) -> None:
        self.resume()

    def resume(self) -> None:
        """What happened since the previous mark is no phase's."""
        self._syncs_at_mark = self._syncs_now()
        if self._counter is not None:
            self._counter.take()
        if self._profile is not None:
            self._profile.resume()

    def end(self, phase: str) -> None:
        now = self._syncs_now()
        self._step_syncs[phase] += now - self._syncs_at_mark
        self._syncs_at_mark = now
        if self._counter is not None:
            ops = self._counter.take()
            self.ops[phase] = self.ops.get(phase, 0) + sum(ops.values())
            by_name = Counter(self.ops_by_name.get(phase, {})) + ops
            self.ops_by_name[phase] = dict(by_name.most_common())
        if self._profile is not None:
            self._profile.end(phase)

    def summary(self, measured: slice) -> dict:
        """Per phase: the ops and kernels of the counted steps, and the mean host syncs per measured
        step (GPU)."""
        result = dict(kernels=self.ops, kernel_ops=self.ops_by_name)
        if self.cuda_kernels is not None:
            result["cuda_kernels"] = self.cuda_kernels
        steps = self.host_syncs[measured]
        if steps:
            phases = {phase for step in steps for phase in step}
            result["host_syncs"] = {phase: sum(step.get(phase, 0) for step in steps) / len(steps) for phase in phases}
        return result


class InstrumentedPhases:
    """A ``StepPhases`` whose marks also reach the instruments; otherwise the same object."""

    def __init__(self, phases, instruments: StepInstruments) -> None:
        self._phases, self._instruments = phases, instruments

    def begin(self) -> None:
        self._phases.begin()
        self._instruments.begin()

    def end(self, phase: str) -> None:
        self._phases.end(phase)
        self._instruments.end(phase)

    def resume(self) -> None:
        self._phases.resume()
        self._instruments.resume()

    def __getattr__(self, name: str):
        return getattr(self._phases, name)


def profile_step_on(device: torch.device, after: int) -> int | None:
    """The step whose CUDA kernels are counted: ``after`` on CUDA, none elsewhere."""
    return after if device.type == "cuda" else None
