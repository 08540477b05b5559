"""What a training run tells its operator: the JSON-lines log, the Prometheus metrics and the
console, for each step, log step, epoch and the end of the run (the trainer only reports events)."""

from __future__ import annotations

import math
import sys
import time
from typing import Callable

import torch
from tqdm import tqdm

from trainer.observability.logs import JsonlLog, memory_readings
from trainer.observability.memory import peak_rss_bytes
from trainer.observability.metrics import TrainingMetrics
from trainer.observability.progress import ProgressLines, on_terminal
from trainer.observability.trainjob_status import TrainJobStatusReporter
from trainer.observability.what_runs import what_runs_line


class RunRecord:
    def __init__(self, log: JsonlLog, metrics: TrainingMetrics, rank: int, device: torch.device) -> None:
        self.log, self.metrics, self.rank, self.device = log, metrics, rank, device
        # The run summary's throughput: images over training time (no start-up, saves or
        # evaluations); a resumed run counts from its restart.
        self.images_this_run, self.train_seconds = 0, 0.0
        self._window_start, self._window_images, self._window_wait = time.perf_counter(), 0, 0.0
        self._window_phases: dict[str, float] = {}
        self._window_phase_steps = 0
        self.progress: ProgressLines | None = None
        self.run: str | None = None  # the run's token (the trainer's), in its step records
        # Set to lists by `instcls bench step`: every step's host times, and its phases once the
        # device has passed them (host-side records only: keeping them costs the step nothing).
        self.step_history: list[dict[str, float]] | None = None
        self.phase_history: list[dict[str, float]] | None = None
        self.host_syncs_so_far: Callable[[], int] | None = None  # the bench's count, read at each step's end
        self.trainjob: TrainJobStatusReporter | None = None  # rank 0 with logging.trainjob_status
        self._scores: dict[str, float] = {}  # the last evaluation's, for the TrainJob's status

    def show_progress(self, logging_section, total_steps: int, max_steps: int | None, steps_per_epoch: int) -> None:
        """Rank 0 with ``logging.progress`` off a terminal: plain lines at log steps (the bar needs a terminal)."""
        last_step = total_steps if max_steps is None else min(total_steps, max_steps)
        if self.rank == 0 and logging_section.progress and not on_terminal(sys.stderr):
            self.progress = ProgressLines(last_step, steps_per_epoch, logging_section.progress_every_s)
        if self.rank == 0 and logging_section.trainjob_status:
            self.trainjob = TrainJobStatusReporter.from_environment(last_step, logging_section.progress_every_s,
                                                                    self.say)

    def say(self, message: str) -> None:
        self.log.write(event="message", message=message)
        if self.rank == 0:
            tqdm.write(f"[instcls] {message}")

    def started(self, facts: dict[str, object]) -> None:
        """Every rank, once, to its log and its console: a node on the wrong device or library shows at once."""
        self.log.write(event="start", **facts)
        tqdm.write(f"[instcls] {what_runs_line(facts)}", file=sys.stderr)

    def skipped(self, problems: tuple[str, ...], step: int) -> None:
        """Unreadable samples the loader skipped (``on_bad_sample: skip``): counted and named by every rank."""
        self.metrics.bad_samples.inc(len(problems))
        for problem in problems:
            self.log.write(event="bad_sample_skipped", step=step, problem=problem)
            tqdm.write(f"[instcls] rank {self.rank}: skipped an unreadable sample: {problem}", file=sys.stderr)

    def objective_metrics(self, objective) -> dict[str, float]:
        """The objective's metrics, exported; its collective time feeds the comm counter."""
        values = objective.metrics()
        self.metrics.comm.inc(values.get("comm_seconds", 0.0))
        for name, value in values.items():
            self.metrics.objective.labels(self.metrics.rank, name).set(value)
        return values

    def step_done(self, images: int, data_wait: float, step_seconds: float, epoch_progress: float) -> None:
        self.metrics.samples.inc(images)
        self.images_this_run += images
        self.metrics.data_wait.inc(data_wait)
        self.metrics.step_duration.observe(step_seconds + data_wait)
        self.metrics.epoch_progress.set(epoch_progress)
        self._window_images += images
        self._window_wait += data_wait
        if self.step_history is not None:
            entry = dict(images=images, data_wait=data_wait, step=step_seconds)
            if self.host_syncs_so_far is not None:
                entry["host_syncs_so_far"] = self.host_syncs_so_far()
            self.step_history.append(entry)

    def phases_done(self, steps: list[dict[str, float]]) -> None:
        """Steps the device has finished (``StepPhases.completed``): exported, and summed for the next log line."""
        for seconds in steps:
            if self.phase_history is not None:
                self.phase_history.append(seconds)
            self.metrics.add_phases(seconds)
            for phase, value in seconds.items():
                self._window_phases[phase] = self._window_phases.get(phase, 0.0) + value
            self._window_phase_steps += 1

    def start_window(self) -> None:
        """Throughput is measured from here to the next log step."""
        self._window_start, self._window_images, self._window_wait = time.perf_counter(), 0, 0.0

    def close_window(self) -> tuple[float, float, float]:
        """``(images/s, data wait, seconds)`` since the window started, taken before a log step's syncs."""
        seconds = time.perf_counter() - self._window_start
        window = (self._window_images / seconds, self._window_wait, seconds)
        self.start_window()
        return window

    def log_step(self, epoch: int, step_in_epoch: int, step: int, loss: torch.Tensor, lr: float, objective,
                 window: tuple[float, float, float]) -> None:
        """A log step (a host sync): loss, ``window``'s throughput and data wait, memory, the objective's metrics."""
        loss_value = float(loss)
        memory = memory_readings(self.device)
        objective_metrics = self.objective_metrics(objective)
        self.metrics.loss.set(loss_value)
        self.metrics.set_memory(memory)
        images_per_second, data_wait, seconds = window
        phases = {phase: round(value / self._window_phase_steps, 5) for phase, value in self._window_phases.items()} \
            if self._window_phase_steps else {}
        self._window_phases, self._window_phase_steps = {}, 0
        # null, not NaN, for a skipped step's loss: strict JSON readers (jq, log shippers) reject NaN
        self.log.write(event="step", epoch=epoch, step=step, run=self.run,
                       loss=round(loss_value, 5) if math.isfinite(loss_value)
                       else None, lr=lr, images_per_s=round(images_per_second, 2), data_wait_s=round(data_wait, 4),
                       memory_bytes=memory, phase_seconds_per_step=phases,
                       **{f"objective_{name}": round(value, 4) for name, value in objective_metrics.items()})
        if self.progress is not None:
            self.progress.log_step(epoch, step_in_epoch, step, loss_value, images_per_second, data_wait / seconds)
        if self.trainjob is not None:
            figures = {"loss": loss_value} if math.isfinite(loss_value) else {}
            self.trainjob.log_step(step, {**figures, "images_per_s_per_rank": images_per_second, **self._scores})

    def scored(self, results: dict) -> None:
        """An evaluation's scores: the trained network's kNN (and probe) accuracy goes into the TrainJob's status."""
        if not results:  # no evaluation configured
            return
        self._scores = {name: results[name] for name in ("knn_trained", "linear_trained") if name in results}

    def epoch_done(self, epoch: int, seconds: float, objective) -> None:
        self.train_seconds += seconds
        objective_metrics = self.objective_metrics(objective)
        self.log.write(event="epoch", epoch=epoch, seconds=round(seconds, 3), **objective_metrics)
        self.say(f"epoch {epoch}: {seconds:.1f}s; objective: " +
                 ", ".join(f"{name} {value:.4g}" for name, value in objective_metrics.items()))

    def epoch_stopped(self, seconds: float) -> None:
        """The run stops inside an epoch (max_steps, SIGTERM): its steps so far count as training time."""
        self.train_seconds += seconds

    def summary(self, objective_name: str, epochs: int, steps: int, world_size: int,
                stopped_by: str = "finished", eval_failed: str | None = None) -> dict:
        """What the run cost on this rank: throughput and peak memory (CUDA allocator or CPU RSS), how
        it ended ("finished", "max_steps", "sigterm"), and, when its end-of-run evaluation failed, why.
        Returns the record as logged."""
        cuda = self.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else peak_rss_bytes()
        record = dict(event="summary", objective=objective_name, epochs=epochs, steps=steps,
                      seconds=round(self.train_seconds, 3), world_size=world_size, images=self.images_this_run,
                      peak_memory_bytes=peak, peak_memory_kind="cuda_max_allocated" if cuda else "rss_high_water",
                      stopped_by=stopped_by, **({"eval_failed": eval_failed} if eval_failed else {}))
        self.log.write(**record)
        if self.trainjob is not None:  # the run's end: its last step and scores, then the sender stops
            self.trainjob.close(steps, self._scores)
        return record
