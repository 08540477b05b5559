"""One rank of a job on fake CUDA devices: the objective built at the job's N and a few steps run.

The process joins a ``fake`` process group as rank R of T (collectives return at once and move no
data), builds the job's objective on fake ``cuda:<R mod 8>`` tensors, starts an epoch and runs
``steps`` steps: the objective's loss on stand-in head features (random, of the backbone's dtype
and the loader's view layout), the backward (``dry_run.backward``), ``after_backward``, the
objective's optimizers and ``after_optimizer_step``.  An objective with a momentum teacher gets
stand-in teacher features too (no gradient), for the views it names.  The sampler is the job's, so
the ids, padding and PIC's sampled rows are the real run's.  What it records: the device memory peak
(PyTorch's ``MemTracker``), every host sync (``host_syncs``), every collective (``collectives``), and
the error that stopped the step (a device mismatch raises ``FakeTensorDeviceMismatchError`` at the
first one).
"""

from __future__ import annotations

import datetime
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from data_pipeline.contract import to_device
from data_pipeline.loading.samplers import SamplerRequest, training_sampler
from trainer.config import JobConfig
from trainer.dry_run.backward import backward
from trainer.dry_run.collectives import Collective, CollectiveRecorder
from trainer.dry_run.compiles import Compilation, CompileRecorder
from trainer.dry_run.fake_cuda import fake_cuda_runtime
from trainer.dry_run.host_memory import RealHostMemory
from trainer.dry_run.host_syncs import HostSync, HostSyncRecorder, innermost_project_frame
from trainer.objectives import ObjectiveContext, StepViews, View, build_objective
from trainer.parallel.dims import DEFAULT_TIMEOUT_S, ParallelDims, build_classifier_groups

GPUS_PER_NODE = 8


@dataclass
class RankReport:
    """What one simulated rank did.  ``step_syncs``: syncs of the steps, each with how many of the
    ``steps`` made it; ``setup_syncs``: those of building the objective and starting the epoch."""

    rank: int
    world_size: int
    steps: int
    peak_bytes: int = 0  # device memory at the steps' peak
    setup_peak_bytes: int = 0  # at the peak of building the objective and starting the epoch (a search, a prior)
    step_syncs: dict[HostSync, int] = field(default_factory=dict)
    setup_syncs: dict[HostSync, int] = field(default_factory=dict)
    compilations: list[list[Compilation]] = field(default_factory=list)  # per step: inductor compiles it asked for
    collectives: list[Collective] = field(default_factory=list)
    stopped: str | None = None  # the error that ended the run early, with its source line
    seconds: float = 0.0


def engine_dtype_of(config: JobConfig) -> torch.dtype:
    """The backbone's output dtype under the job's DeepSpeed config (what the objective receives)."""
    from trainer.engine.deepspeed_setup import load_deepspeed_config
    from trainer.planning import deepspeed_settings

    settings = deepspeed_settings(load_deepspeed_config(config.deepspeed_config, config.data.loader.batch_size))
    return torch.bfloat16 if settings["dtype"] == "bfloat16" else torch.float32


def _fake_dims(config: JobConfig, world_size: int, rank: int) -> ParallelDims:
    size = config.parallel.classifier_parallel_size or world_size
    if world_size % size:
        raise ValueError(f"parallel.classifier_parallel_size={size} does not divide --ranks {world_size}")
    timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)  # the fake groups never wait; given for form
    classifier_group, replica_group = build_classifier_groups(world_size, rank, size, timeout)
    return ParallelDims(world_size=world_size, rank=rank, local_rank=rank % GPUS_PER_NODE,
                        classifier_parallel_size=size, device=torch.device("cuda", rank % GPUS_PER_NODE),
                        backend="nccl", classifier_group=classifier_group, classifier_replica_group=replica_group,
                        control_group=dist.new_group(timeout=timeout) if world_size > 1 else None)


def _stopped_by(error: BaseException) -> str:
    """The error and the innermost line of the project's code it came from."""
    found = innermost_project_frame(traceback.extract_tb(error.__traceback__))
    at = f" at {found}" if found != "?" else ""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}{at}"


def _count(syncs: list[HostSync], into: dict[HostSync, int]) -> None:
    for sync in dict.fromkeys(syncs):
        into[sync] = into.get(sync, 0) + 1


class _StepInputs:
    """What the loader and the backbone would hand the objective at each step, on fake tensors."""

    def __init__(self, config: JobConfig, dims: ParallelDims, num_instances: int, dtype: torch.dtype,
                 sampled_ids: int | None = None) -> None:
        loader = config.data.loader
        samples = num_instances if sampled_ids is None else min(num_instances, sampled_ids)
        self.sampler = training_sampler(SamplerRequest(samples, dims.world_size, loader.batch_size,
                                                       loader.seed, loader.last_batch, loader.sampler))
        self.layout, self.dims, self.dtype = loader.view_layout, dims, dtype
        self.feature_dim = config.model.feature_dim
        self.teacher = config.objective.teacher_request(loader.view_layout)
        self.student = config.objective.student_views(loader.view_layout)

    def _at(self, epoch: int, index: int) -> tuple[int, int]:
        """(epoch, step in it) of the ``index``-th step from the start of ``epoch`` (epochs roll over)."""
        return epoch + index // self.sampler.steps_per_epoch, index % self.sampler.steps_per_epoch

    def step(self, epoch: int, index: int) -> StepViews:
        """The ``index``-th step counted from the start of ``epoch``."""
        epoch, step = self._at(epoch, index)
        plan = self.sampler.step(epoch, step)
        next_plan = self.sampler.step(*self._at(epoch, step + 1))
        rank, device = self.dims.rank, self.dims.device
        student = self.student if self.student is not None else range(self.layout.num_views)
        views = [View(torch.randn(plan.ids.shape[1], self.feature_dim, device=device, dtype=self.dtype,
                                  requires_grad=True), self.layout.kinds[position], position)
                 for position in student]
        teacher = [View(torch.randn(plan.ids.shape[1], self.feature_dim, device=device, dtype=self.dtype),
                        self.layout.kinds[position], position)
                   for position in (self.teacher.views if self.teacher is not None else ())]
        return StepViews(views=views, instance_ids=to_device(plan.ids[rank], device),
                         valid=to_device(plan.valid[rank], device), global_valid=plan.global_valid, epoch=epoch,
                         step=epoch * self.sampler.steps_per_epoch + step, plan=plan, next_plan=next_plan,
                         teacher=teacher)


def run_rank(config: JobConfig, num_instances: int, world_size: int, rank: int, steps: int = 2,
             epoch: int = 0, sampled_ids: int | None = None) -> RankReport:
    """Rank ``rank`` of ``world_size`` running the job's objective for ``steps`` steps on fake devices.

    ``epoch``: the epoch whose first steps run, as a fresh run would (an objective's features that
    start later, such as SwAV's queue, need that epoch).  ``sampled_ids``: draw the batches from the
    first this many ids only (the sampler's permutation is real host memory, 8 bytes per sample:
    25 GB at 3 billion; the classifier's memory does not depend on which ids a batch holds)."""
    report = RankReport(rank, world_size, steps)
    started = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    syncs = HostSyncRecorder(assume_values=True)
    collectives = CollectiveRecorder()
    compiles = CompileRecorder()
    fake_mode = FakeTensorMode()
    try:
        with (fake_mode, fake_cuda_runtime(syncs), compiles.recording(), MemTracker() as memory, collectives, syncs,
              RealHostMemory(fake_mode)):
            try:
                _run(config, num_instances, rank, world_size, steps, epoch, syncs, memory, compiles, report,
                     sampled_ids)
            except Exception as error:  # noqa: BLE001 (the report says what stopped the step, and where)
                report.stopped = _stopped_by(error)
            report.peak_bytes = _peak(memory, rank)
    finally:
        dist.destroy_process_group()
    report.collectives = collectives.collectives
    report.seconds = time.perf_counter() - started
    return report


def _peak(memory: MemTracker, rank: int) -> int:
    return int(memory.get_tracker_snapshot("peak").get(torch.device("cuda", rank % GPUS_PER_NODE), {}).get("Total", 0))


def restart_peak(memory: MemTracker) -> None:
    """From here on the peak starts at what is allocated now (what ``MemTracker.__enter__`` does)."""
    memory._peak_mem_snap = memory.get_tracker_snapshot()
    memory._peak_mem = {device: snapshot["Total"] for device, snapshot in memory._peak_mem_snap.items()}


class _FakeDeviceProbe:
    """What the dry run records around the steps on fake devices (see ``run_objective_steps``)."""

    def __init__(self, syncs: HostSyncRecorder, memory: MemTracker, compiles: CompileRecorder, rank: int) -> None:
        self.syncs, self.memory, self.compiles, self.rank = syncs, memory, compiles, rank

    def setup_done(self, report: RankReport) -> None:
        _count(self.syncs.syncs, report.setup_syncs)
        report.setup_peak_bytes = _peak(self.memory, self.rank)
        restart_peak(self.memory)

    def step_started(self) -> None:
        self.syncs.syncs.clear()
        self.compiles.compilations = []
        self.memory.reset_mod_stats()  # per-module figures are per call; the device peak carries on

    def step_done(self, report: RankReport) -> None:
        _count(self.syncs.syncs, report.step_syncs)
        report.compilations.append(self.compiles.compilations)


def _run(config: JobConfig, num_instances: int, rank: int, world_size: int, steps: int, epoch: int,
         syncs: HostSyncRecorder, memory: MemTracker, compiles: CompileRecorder, report: RankReport,
         sampled_ids: int | None = None) -> None:
    run_objective_steps(config, _fake_dims(config, world_size, rank), num_instances, steps, epoch, report,
                        _FakeDeviceProbe(syncs, memory, compiles, rank), sampled_ids)


def run_objective_steps(config: JobConfig, dims: ParallelDims, num_instances: int, steps: int, epoch: int,
                        report: RankReport, probe, sampled_ids: int | None = None) -> None:
    """Build the job's objective on ``dims`` and run ``steps`` steps on stand-in head features;
    ``probe`` (``setup_done``, ``step_started``, ``step_done``) records what it measures into ``report``
    (fake devices here, a real GPU in ``dry_run.on_device``)."""
    inputs = _StepInputs(config, dims, num_instances, engine_dtype_of(config), sampled_ids)
    context = ObjectiveContext(
        dims=dims, num_instances=num_instances, feature_dim=config.model.feature_dim, seed=config.seed,
        optim=config.optim.objective_settings(config.optim.on_nonfinite == "skip_step"),  # as the trainer passes it
        views=inputs.layout, global_batch=config.data.loader.batch_size * dims.world_size,
    )
    objective = build_objective(config.objective, context)
    objective.on_epoch_start(epoch)
    probe.setup_done(report)
    first_epoch = epoch
    for index in range(steps):
        probe.step_started()
        step = inputs.step(first_epoch, index)
        if step.epoch != epoch:  # the steps rolled into the next epoch (a small N)
            epoch = step.epoch
            objective.on_epoch_start(epoch)
        optimizers = objective.optimizers()
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = 0.1
        backward(objective.loss(step).loss)
        objective.after_backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        objective.after_optimizer_step(True)
        probe.step_done(report)
