"""The training job: DeepSpeed backbone + head, one objective, checkpoints, metrics, a clean stop.

One step on each rank::

    views -> engine (backbone + head, ZeRO) -> features per view [b, D]
          (-> the momentum teacher, no grad, on the views it encodes, if the objective asked for one)
          -> objective.loss(StepViews)                 # e.g. the sharded instance classifier
    engine.backward(loss); engine.step()             # backbone grads averaged over all ranks
    objective.after_backward(); its optimizers step  # objective parameters live outside ZeRO
    teacher moves towards the student's fp32 masters; objective.after_optimizer_step()

The trainer never names a method: everything method-specific is behind ``trainer.objectives``.
Host syncs happen only on log steps (loss value, input validation, NaN check, comm timers) and on
checkpoint steps.  SIGTERM is agreed on with one tiny CPU all-reduce per step that runs in the
background and is read a step later (``StopSignal.stop_after_step``); under ``optim.on_nonfinite:
skip_step`` the step is dropped by a flag on the device (``DeviceStepSkipper``: instance at ZeRO-0)
or, elsewhere, a blocking all-reduce agrees before the backward whether any rank's loss is finite.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.contract import build_loader, load_manifest, use_storage_settings
from trainer.checkpoint.async_checkpoint import AsyncCheckpointer
from trainer.checkpoint.batch_norm_state import BatchNormState
from trainer.checkpoint.checkpoint_files import read_trainer_meta, resolve_resume_on_rank0
from trainer.checkpoint.components import FieldsState, load_checkpoint
from trainer.checkpoint.engine_state import EngineState
from trainer.checkpoint.initial_weights import starting_network
from trainer.checkpoint.rng_state import RngState
from trainer.checkpoint.run_end import finished_run_note
from trainer.checkpoint.run_fingerprint import refuse_another_jobs_checkpoint, run_fingerprint
from trainer.checkpoint.teacher_state import TeacherState
from trainer.checkpoint.tracking_state import TrackingState, tracked_run_id
from trainer.classifier.classifier_config import HeadSettings
from trainer.config import JobConfig
from trainer.elastic.restart_cost import restart_cost
from trainer.engine.deepspeed_host_syncs import host_reads_per_step
from trainer.engine.deepspeed_setup import engine_dtype, initialize_backbone, load_deepspeed_config
from trainer.engine.device_skip import nonfinite_guards
from trainer.engine.replicated_state import OneNetwork
from trainer.engine.resumed_settings import settings_for_this_run
from trainer.engine.run_record import RunRecord
from trainer.engine.schedule import StepSchedules, refuse_unused_objective_settings, scaled_lr
from trainer.engine.step_skipping import StepSkipper
from trainer.engine.stop_conditions import NonFiniteWatch, StopSignal
from trainer.engine.teacher_setup import TeacherSetup
from trainer.engine.training_eval import TrainingEvaluation, evaluate_finished_run
from trainer.engine.view_forward import forward_views
from trainer.failpoints import fail_point, wait_point
from trainer.models.backbone import model_input
from trainer.objectives import ObjectiveContext, StepViews, build_objective, objective_parameters
from trainer.observability.logs import JsonlLog
from trainer.observability.metrics import TrainingMetrics
from trainer.observability.mlflow_sink import open_mlflow_sink
from trainer.observability.progress import epoch_bar
from trainer.observability.run_end_files import attach_run_end
from trainer.observability.step_phases import StepPhases
from trainer.observability.tensorboard_scalars import open_tensorboard_scalars
from trainer.observability.what_runs import what_runs
from trainer.parallel import ParallelDims
from trainer.parallel.batch_norm import apply_batch_norm_mode, batch_norm_group, statistics_differ_by_rank
from trainer.parallel.rank0_work import run_on_rank0
from trainer.provenance.run_provenance import RUN_FILE
from trainer.provenance.run_start import ConfigOrigin, record_run_start


@dataclass
class TrainerState:
    """Where training stands; ``step_in_epoch`` batches of ``epoch`` are already done."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0


@dataclass
class TrainResult:
    state: TrainerState
    stopped_by: str  # "finished", "max_steps" or "sigterm"
    last_checkpoint: Path | None
    scores: dict | None = None  # the final FrozenFeatureScores.score, when eval shards are set


class Trainer:
    def __init__(self, config: JobConfig, dims: ParallelDims, resume: str | None = None,
                 origin: ConfigOrigin | None = None,
                 model_card: Callable[[JobConfig, Path], str] | None = None) -> None:
        """``model_card``: the card of a checkpoint, for the trackers that keep a finished run's files
        (the command line passes the export's; the engine sits below the export layer)."""
        self.config, self.dims = config, dims
        self.model_card = model_card
        self.log = JsonlLog(config.logging.dir, dims.rank,
                            [open_tensorboard_scalars(config.logging.tensorboard, config.logging.dir, dims.rank)])
        self.metrics = TrainingMetrics(dims.rank)
        self.record = RunRecord(self.log, self.metrics, dims.rank, dims.device)
        self.phases = StepPhases(dims.device)  # where each step's time goes, without a device sync
        self._say = self.record.say
        self.record.started(what_runs(dims))
        if config.logging.metrics_port:  # first, so a taken port stops the job before minutes of set-up
            self.metrics.serve(config.logging.metrics_port + dims.local_rank, config.logging.metrics_bind)
        use_storage_settings(config.data.storage)  # how this process reaches s3:// shard sets
        manifest = load_manifest(config.data.train_shards)
        self.num_instances = manifest.num_instances
        # The checkpoint first: its global batch sets this run's per-rank batch on any world size.
        resumed = resolve_resume_on_rank0(resume, config.checkpoint.dir, dims, self._say)
        # One token per run of the job, the same on its ranks: the records of a run restarted on
        # other ranks (elastic) tell apart which run last trained a step.
        self.run_token = run_on_rank0(lambda: uuid.uuid4().hex[:12],
                                      dims.control_group if dims.is_distributed else None)
        self.record.run = self.run_token
        self.resumed_meta = read_trainer_meta(resumed) if resumed is not None else None
        self.resumed, self.finished_note = resumed, finished_run_note(resumed, self.resumed_meta, config.optim.epochs)
        if self.finished_note is not None:  # a finished run: train() says so, trains and evaluates nothing
            refuse_another_jobs_checkpoint(resumed, run_fingerprint(config, self.num_instances))  # as on any resume
            self.state = TrainerState(*(self.resumed_meta[key] for key in ("epoch", "step_in_epoch", "global_step")))
            return
        settings = settings_for_this_run(config, dims.world_size, resumed, self.resumed_meta, dims.device,
                                         manifest.num_instances)
        config = self.config = settings.config
        for note in settings.notes:
            self._say(note)
        self.provenance = record_run_start(config, dims, self.run_token, origin, resumed)
        loader_config = config.data.loader
        self.global_batch = settings.split.global_batch
        peak_lr = scaled_lr(config.optim.base_lr, config.optim.base_batch, self.global_batch)

        # The objective validates its settings against the data before DeepSpeed starts.
        self.skip_nonfinite = config.optim.on_nonfinite == "skip_step"
        self.views = loader_config.view_layout  # the loader's, fixed for the job
        context = ObjectiveContext(
            dims=dims, num_instances=manifest.num_instances, feature_dim=config.model.feature_dim, seed=config.seed,
            optim=config.optim.objective_settings(self.skip_nonfinite),
            views=self.views, global_batch=self.global_batch,
        )
        self.objective = build_objective(config.objective, context)
        self.student_views = self.objective.student_views()  # None: every view
        refuse_unused_objective_settings(config.optim, self.objective, config.objective.name)
        teacher = TeacherSetup.of_job(self.objective, config, dims)  # None, or refused here when it cannot be kept

        model = starting_network(config, self._say, resumed)  # the same initial network on every rank
        # Scored next to the trained network: does training beat the architecture alone?
        baseline = "init_from" if config.model.init_from is not None and resumed is None else "random_init"
        self.evaluation = TrainingEvaluation.of_job(config, dims, model, self.log, self.metrics, self._say, baseline)
        one_rank_collectives = config.parallel.collectives_over_one_rank
        batch_norm = batch_norm_group(config.model.batch_norm, config.model.sync_batch_norm_group, dims)
        if teacher is not None:
            teacher.copy_network(model)  # the student's initial network, before DeepSpeed takes it
        model = apply_batch_norm_mode(model, config.model.batch_norm, batch_norm, one_rank_collectives)
        if config.model.compile:
            model.compile()  # in place: DeepSpeed's engine and the checkpoints see the same module and names
        ds_config = load_deepspeed_config(config.deepspeed_config, loader_config.batch_size,
                                          config.optim.clip_grad_norm)
        self.engine, self.backbone_optimizer = initialize_backbone(
            model, ds_config, peak_lr, settings=config.optim.optimizer_settings()
        )
        self.dtype = engine_dtype(self.engine)
        if reads := host_reads_per_step(ds_config):  # each a stall of the host, every step
            self._say(f"{config.deepspeed_config.name}: DeepSpeed reads the host every step: {'; '.join(reads)}")

        self.train_loader = build_loader(config.data.train_shards, loader_config, dims.rank, dims.world_size,
                                         dims.device, train=True)
        self.steps_per_epoch = self.train_loader.steps_per_epoch
        total_steps = config.optim.epochs * self.steps_per_epoch
        self.teacher = (teacher.build(self.engine, total_steps, batch_norm, one_rank_collectives)
                        if teacher is not None else None)
        # The backbone's learning rate and the objective's (optim.objective_base_lr), one shape.
        self.schedules = StepSchedules.of_job(config.optim, self.global_batch, self.steps_per_epoch)
        self.record.show_progress(config.logging, total_steps, config.max_steps, self.steps_per_epoch)

        self.state = TrainerState()
        self.fingerprint = run_fingerprint(config, self.num_instances)
        self.restarts = self.resumed_meta.get("restarts", 0) + 1 if self.resumed_meta else 0  # resumes so far
        # Everything a checkpoint holds, restored in this order: the RNG last, after the position
        # it reseeds from on a new world size and after anything that might draw from it.
        # rank 0 mirrors the log into MLflow (logging.mlflow); a resume continues the MLflow run its checkpoint names
        self.tracking = open_mlflow_sink(config.logging.mlflow, config, self.provenance.provenance, self.restarts,
                                         tracked_run_id(resumed), dims.rank, self._say)
        self.log.add_sink(self.tracking)
        self.log.attach(config.logging.dir / RUN_FILE, RUN_FILE)
        self.checkpoint_state = {
            "trainer": FieldsState(self.state, num_instances=self.num_instances, fingerprint=self.fingerprint,
                                   global_batch=self.global_batch, restarts=self.restarts),
            "engine": EngineState(self.engine, log=self._say, network_statistics=self._network_statistics),
            "batch_norm": BatchNormState(self.engine.module),  # each rank's own statistics, after the engine's
            **({"teacher": TeacherState(self.teacher, teacher.statistics_differ(batch_norm))} if self.teacher else {}),
            "objective": self.objective,
            "sampler": self.train_loader.sampler,
            "provenance": self.provenance,  # run.json: what made the weights beside it
            "tracking": TrackingState(lambda: self.tracking.run_id if self.tracking is not None else None),
            "rng": RngState(config.seed, self.state),
        }
        averaged = statistics_differ_by_rank(config.model.batch_norm, batch_norm, dims)
        self.one_network = OneNetwork(self.engine.module, self.checkpoint_state, averaged, dims,
                                      self.engine.zero_optimization_stage() < 3, self.log, self._say)
        self.metrics.world_size.set(dims.world_size)
        if resumed is not None:
            self._restore(resumed)
        self.checkpointer = AsyncCheckpointer(config.checkpoint.dir, dims, config.checkpoint.keep_last, self._say,
                                              last_complete=resumed)

        self.metrics.shard_bytes.set(sum(p.numel() * p.element_size() for p in objective_parameters(self.objective)))
        self.metrics.steps_per_epoch.set(self.steps_per_epoch)
        self.metrics.epochs_planned.set(config.optim.epochs)
        self.stop_signal = StopSignal(dims.control_group)
        self.nonfinite = NonFiniteWatch(dims.device)
        self.skipper = StepSkipper(self.engine.module, self.objective, config.optim.max_skipped_in_a_row, self.metrics,
                                   self.log, self._say)
        # skip_step on the device (no host read per step) where it can be, else the blocking agreement above
        self.device_skip, self.gradient_watch = nonfinite_guards(
            self.engine, self.backbone_optimizer, self.objective, self.skip_nonfinite,
            config.optim.max_skipped_in_a_row, dims, self.metrics, self.log, self._say, one_rank_collectives)

    # -- helpers ---------------------------------------------------------------------------

    def _restore(self, path: Path) -> None:
        refuse_another_jobs_checkpoint(path, self.fingerprint)  # before any tensor fails to fit
        load_checkpoint(path, self.checkpoint_state, self.dims)
        self._say(f"resumed from {path} at epoch {self.state.epoch} step {self.state.global_step}")
        self.metrics.restarts.set(self.restarts)
        if self.dims.rank == 0:  # every rank's logs, read once
            cost = restart_cost(self.config.logging.dir, time.time(), self.resumed_meta, self.dims.world_size)
            self.log.write(event="restart", **cost.as_record())
            self._say(cost.describe())
            self.metrics.steps_lost.set(cost.steps_lost)
            if cost.stopped_seconds is not None:
                self.metrics.restart_seconds.set(cost.stopped_seconds)

    def _save(self, wait: bool = False) -> Path | None:
        """Checkpoint this step: the step waits for a snapshot and the files are written in the
        background; ``wait`` (the last save, a preemption's): complete before returning (its path)."""
        if self.checkpointer.holds(self.state.global_step):  # saved, or being saved
            return self.checkpointer.wait() if wait else None
        self.one_network.agree(self.state.global_step, "save")  # model.pt: the ranks' one network
        # ZeRO-3 keeps each rank's partition in ds_tensor; the check covers every rank's own part.
        local_parameters = [getattr(p, "ds_tensor", p) for p in self.engine.module.parameters()]
        self.nonfinite.observe_parameters([*objective_parameters(self.objective), *local_parameters])
        step, last = self.state.global_step, self.checkpointer.last_complete
        self.nonfinite.check(self.dims.control_group, step, str(last or ""))
        self.checkpointer.save(step, self.checkpoint_state, blocking=wait)  # after the one in flight

    def _network_statistics(self):
        return self.one_network.statistics()

    def _encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.engine(model_input(images, self.dtype, self.config.model))

    def _inference_batches(self):
        loader = build_loader(self.config.data.train_shards, self.config.data.loader, self.dims.rank,
                              self.dims.world_size, self.dims.device, train=False)
        return loader.epoch_batches(0)

    # -- the loop --------------------------------------------------------------------------

    def train(self) -> TrainResult:
        try:
            if self.finished_note is not None:
                self._say(self.finished_note)
                return TrainResult(self.state, "finished", self.resumed)
            return self._train()
        finally:
            self.log.close()  # and its TensorBoard events, flushed: on a NaN stop or a crash too

    def _train(self) -> TrainResult:
        config, state = self.config, self.state
        self.engine.train()  # the objective's start-up pass (e.g. the contrastive prior) sees train-mode BatchNorm
        self.nonfinite.start_at(state.global_step)
        if self.device_skip is not None:
            self.device_skip.start_at(state.global_step)
        start = time.perf_counter()
        self.objective.on_train_start(self._encode, self._inference_batches)
        kernel = (f"; {config.objective.kernel_choice(config.data.loader.view_layout, self.dims.device)}"
                  if isinstance(config.objective, HeadSettings) else "")
        self._say(f"objective {config.objective.name} ready in {time.perf_counter() - start:.1f}s{kernel}")
        stopped_by = "finished"
        try:
            while state.epoch < config.optim.epochs:
                stopped_by = self._train_epoch()
                if stopped_by != "finished":
                    break
            else:
                self._save(wait=True)
            self.stop_signal.settle()  # not on an error: a rank that failed may never join it
        finally:
            self.checkpointer.close()  # the save in flight finishes (on an error too: it is a good one)
            self.stop_signal.restore()
        scores = None  # after the final checkpoint: a failure here is recorded, not raised (nor run on a resume)
        if stopped_by == "finished":
            scores = evaluate_finished_run(
                self.evaluation, lambda: self.evaluation.run(self.engine, self.one_network, state, True, self.record),
                self.checkpointer.last_complete, self.dims.rank, self._say)
        # Every clean end (the last epoch, max_steps, SIGTERM) logs what the run cost, its peak memory
        # included, and how its final evaluation went.
        summary = self.record.summary(config.objective.name, state.epoch, state.global_step, self.dims.world_size,
                                      stopped_by, eval_failed=(scores or {}).get("eval_failed"))
        if self.tracking is not None:  # rank 0's tracker keeps the run's end as files
            attach_run_end(self.log, config, summary, self.checkpointer.last_complete, self._say, self.model_card)
        return TrainResult(state, stopped_by, self.checkpointer.last_complete, scores)

    def _train_epoch(self) -> str:
        config, state, dims = self.config, self.state, self.dims
        epoch = state.epoch
        self.metrics.epoch.set(epoch)
        epoch_start = time.perf_counter()
        self.objective.on_epoch_start(epoch)
        self.engine.train()
        bar = epoch_bar(self.steps_per_epoch, state.step_in_epoch, epoch, config.logging.progress and dims.rank == 0)
        self.record.start_window()
        wait_start = time.perf_counter()
        # The loader starts at the first step not yet done: nothing before it is read or decoded.
        for batch in self.train_loader.epoch_batches(epoch, state.step_in_epoch):
            if config.max_steps is not None and state.global_step >= config.max_steps:
                self.record.epoch_stopped(time.perf_counter() - epoch_start)
                self._save(wait=True)
                bar.close()
                return "max_steps"
            data_wait = time.perf_counter() - wait_start
            if batch.skipped:
                self.record.skipped(batch.skipped, state.global_step + 1)
            if batch.reads is not None:
                self.metrics.add_reads(batch.reads)
            step_start = time.perf_counter()
            self.phases.begin()
            log_step = (state.global_step + 1) % config.logging.log_every == 0 or state.global_step == 0
            loss, stop_agreed = self._step(batch, validate=log_step)
            state.global_step += 1
            state.step_in_epoch += 1
            if config.logging.consumed_ids:  # padding repeats are not consumed; host arrays: no device sync
                self.log.write(event="consumed", epoch=epoch, step=state.global_step, run=self.run_token,
                               ids=batch.host_instance_ids[batch.host_valid].tolist())
            self.record.step_done(batch.instance_ids.shape[0], data_wait, time.perf_counter() - step_start,
                                  state.step_in_epoch / self.steps_per_epoch)
            bar.update(1)
            self.checkpointer.poll()  # logs a background save that finished
            if log_step:
                window = self.record.close_window()  # the throughput, before the syncs below
                if self.device_skip is not None:
                    self.device_skip.check(state.global_step, self.checkpointer.last_complete)
                self.nonfinite.check(dims.control_group, state.global_step, str(self.checkpointer.last_complete or ""))
                self.record.log_step(epoch, state.step_in_epoch, state.global_step, loss,
                                     self.schedules.backbone.lr_at(state.global_step - 1), self.objective, window)
            every = config.checkpoint.every_steps
            if every and state.global_step % every == 0:
                self.phases.resume()
                self._save()  # the snapshot; the files are written in the background
                self.phases.end("checkpoint")
            self.phases.finish()
            self.record.phases_done(self.phases.completed())
            if stop_agreed if stop_agreed is not None else self.stop_signal.stop_after_step():
                self._say(f"SIGTERM: saving at step {state.global_step} and exiting")
                self.record.epoch_stopped(time.perf_counter() - epoch_start)
                self._save(wait=True)  # after the save in flight, if any
                bar.close()
                return "sigterm"
            wait_start = time.perf_counter()
        bar.close()
        self.record.epoch_done(epoch, time.perf_counter() - epoch_start, self.objective)
        state.epoch += 1
        state.step_in_epoch = 0
        if config.checkpoint.every_epochs and state.epoch % config.checkpoint.every_epochs == 0:
            self._save()
        every = config.eval.every_epochs
        if every and self.evaluation is not None and state.epoch % every == 0 and state.epoch < config.optim.epochs:
            self.evaluation.run(self.engine, self.one_network, state, False, self.record)  # the last one: at the end
        return "finished"

    def _step(self, batch, validate: bool) -> tuple[torch.Tensor, bool | None]:
        """One step; returns its loss and, under ``skip_step``, the SIGTERM agreement it already
        reached (None: not reached yet)."""
        self.metrics.lr.set(self.schedules.apply(self.state.global_step, self.backbone_optimizer, self.objective))
        optimizers = self.objective.optimizers()
        blocking_skip = self.skip_nonfinite and self.device_skip is None
        buffers = self.skipper.before_forward() if self.skip_nonfinite else None  # either path puts them back
        if self.teacher is not None and self.skip_nonfinite:
            self.teacher.remember_buffers()
        views = forward_views(self.engine, batch.views, self.views, self.dtype, self.config.model,
                              self.state.global_step + 1, self.student_views)
        teacher_views = (self.teacher.encode(batch.views, self.views, self.dtype, self.config.model)
                         if self.teacher is not None else [])
        self.phases.end("forward")
        step = StepViews(views=views, instance_ids=batch.instance_ids, valid=batch.valid,
                         global_valid=batch.global_valid, epoch=self.state.epoch, step=self.state.global_step,
                         validate=validate, plan=batch.plan, next_plan=batch.next_plan, teacher=teacher_views)
        out = self.objective.loss(step)
        self.phases.end("objective")
        loss = out.loss
        stop_agreed = None
        if blocking_skip:
            stop_agreed, nonfinite = self.stop_signal.agree(loss)
            if nonfinite:
                if self.teacher is not None:
                    self.teacher.restore_buffers()
                self.skipper.skip(buffers, self.state.global_step + 1, self.checkpointer.last_complete)
                return loss.detach(), stop_agreed
            self.skipper.kept()
        self.engine.backward(loss)
        self.phases.end("backward")
        fail_point("train.after_backward", self.state.global_step + 1)  # the fault drills' node loss mid-step
        wait_point("train.wait_for_sigterm", self.state.global_step + 1, lambda: self.stop_signal.requested)
        apply = None
        if self.device_skip is not None:
            self.objective.after_backward()  # first: the rows' gradient, reduced, is part of the flag
            apply = self.device_skip.decide(loss)
        skipped_by_deepspeed = self.engine.skipped_steps  # a host int: DeepSpeed's own overflow drops
        self.engine.step()
        if apply is None:
            self.objective.after_backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # the device's flag at ZeRO-0 under skip_step (never read here), else whether DeepSpeed stepped
        taken = apply if apply is not None else self.engine.skipped_steps == skipped_by_deepspeed
        if self.teacher is not None:
            self.teacher.after_step(self.state.global_step, taken)
        self.objective.after_optimizer_step(taken)
        self.phases.end("optimizer")
        if apply is not None:  # a dropped step is by design: the watch sees the kept ones, finite by the flag
            self.device_skip.after_step(apply, buffers)
            self.nonfinite.observe(torch.where(apply, loss.detach(), torch.zeros_like(loss)))
        else:
            self.nonfinite.observe(loss, self.gradient_watch.take(self.engine.skipped_steps != skipped_by_deepspeed))
        return (loss if out.reported is None else out.reported).detach(), stop_agreed
