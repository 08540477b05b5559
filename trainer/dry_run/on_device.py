"""The dry run's step on a real GPU: what the fake devices predicted, measured by the device.

``run_rank_on_device`` runs exactly the dry run's step (``rank_step.run_objective_steps``: the job's
objective at its full N as rank R of T, stand-in head features, the backward and the optimizers)
with the same ``fake`` process group (collectives return at once and move no data, so one GPU plays
one rank of a 64-GPU job), but on this machine's first GPU with real tensors.  It records:

- the device memory peak of building the objective and of the steps, from the caching allocator's
  own counters (``torch.cuda.max_memory_allocated``), to set beside the dry run's ``MemTracker``
  figure and ``instcls plan``;
- every host sync of the steps after the first, as CUDA's sync debug mode reports it (the device's
  own count, independent of the dry run's op classifier), with the project's source line;
- the seconds per step (device work only: no collective moves data).

The all-gathered features hold whatever the allocator's memory held (the fake group writes
nothing), so the loss value means nothing here; memory and syncs do not depend on it.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer.config import JobConfig
from trainer.dry_run.host_syncs import device_sync_sites
from trainer.dry_run.rank_step import RankReport, _fake_dims, _stopped_by, run_objective_steps


class _DeviceProbe:
    """Peaks from the allocator, syncs from CUDA's sync debug mode, step times from the host clock
    after a synchronize (the step's end, not inside it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step_seconds: list[float] = []
        self._syncs: list[str] = []
        self._started = 0.0
        self._counting = None

    def setup_done(self, report: RankReport) -> None:
        torch.cuda.synchronize(self.device)
        report.setup_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def step_started(self) -> None:
        torch.cuda.synchronize(self.device)
        self._counting = device_sync_sites()
        self._syncs = self._counting.__enter__()
        self._started = time.perf_counter()

    def stop_counting(self) -> None:
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None

    def step_done(self, report: RankReport) -> None:
        self.stop_counting()
        torch.cuda.synchronize(self.device)
        self.step_seconds.append(time.perf_counter() - self._started)
        first = len(self.step_seconds) == 1  # allocates, may compile: its syncs are not the steady state
        for where in dict.fromkeys([] if first else self._syncs):
            report.step_syncs[where] = report.step_syncs.get(where, 0) + 1
        report.compilations.append([])
        report.peak_bytes = torch.cuda.max_memory_allocated(self.device)


@dataclasses.dataclass
class DeviceRankReport:
    report: RankReport
    step_seconds: list[float]
    device_name: str

    def agrees(self) -> bool:
        """The device ran every step and saw no host sync after the first."""
        return self.report.stopped is None and not self.steady_syncs()

    def steady_syncs(self) -> dict[str, int]:
        """Syncs of the steps after the first, each with the number of steps it was in."""
        return self.report.step_syncs


def run_rank_on_device(config: JobConfig, num_instances: int, world_size: int, rank: int = 0, steps: int = 3,
                       epoch: int = 0, sampled_ids: int | None = None) -> DeviceRankReport:
    """The dry run's ``run_rank`` with real tensors on ``cuda:0`` (see the module docstring)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the dry run on a device needs a GPU: torch.cuda.is_available() is False")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    report = RankReport(rank, world_size, steps)
    probe = _DeviceProbe(device)
    started = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        dims = dataclasses.replace(_fake_dims(config, world_size, rank), device=device, local_rank=0)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            run_objective_steps(config, dims, num_instances, steps, epoch, report, probe, sampled_ids)
        except Exception as error:  # noqa: BLE001 (the report says what stopped the step, and where)
            probe.stop_counting()
            report.stopped = _stopped_by(error)
    finally:
        dist.destroy_process_group()
    report.seconds = time.perf_counter() - started
    return DeviceRankReport(report, probe.step_seconds, torch.cuda.get_device_name(device))


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 30):.2f}"


def format_comparison(predicted, measured: DeviceRankReport) -> str:
    """The device's figures beside the dry run's (``predicted``: a ``job.DryRunResult``) and the plan's."""
    fake, real = predicted.report, measured.report
    seconds = measured.step_seconds[1:] or measured.step_seconds
    lines = [
        "",
        f"the same step on {measured.device_name} (real tensors, rank {real.rank} of {real.world_size}; "
        "torch.cuda.max_memory_allocated):",
        f"{'memory per rank (GiB)':<40}{'device':>10}{'dry run':>10}{'planned':>10}",
        f"{'  objective step (peak)':<40}{_gib(real.peak_bytes):>10}{_gib(fake.peak_bytes):>10}"
        f"{_gib(predicted.planned_objective):>10}",
        f"{'  building it, starting the epoch (peak)':<40}{_gib(real.setup_peak_bytes):>10}"
        f"{_gib(fake.setup_peak_bytes):>10}{'-':>10}",
    ]
    if real.stopped:
        lines.append(f"the device run stopped: {real.stopped}")
    syncs = measured.steady_syncs()
    lines.append(f"host syncs per step after the first (CUDA's sync debug mode): {'none' if not syncs else len(syncs)}")
    lines += [f"  {steps}/{real.steps - 1} steps  {where}" for where, steps in syncs.items()]
    if seconds:
        lines.append(f"seconds per step (device work only; the fake group moves no data): "
                     f"{sorted(seconds)[len(seconds) // 2]:.4f} median of {len(seconds)}")
    return "\n".join(lines)
