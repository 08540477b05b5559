"""The fault drills: each one breaks a real 2-rank CPU job the way a cluster does, then checks
what survived against a run that was never interrupted.

Every drill returns a ``DrillResult``; ``passed`` is computed from what the job left on disk and
printed, never assumed.  Jobs train the embedded digits for 4 steps with a checkpoint every 2.
"""

from __future__ import annotations

import math
import re
import resource
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

import torch

from data_pipeline.shards import ShardSettings, write_shards
from data_pipeline.sources import sklearn_digits
from trainer.drills.jobs import LAUNCH, REPO, Job, accounting_difference, job_env, state_difference
from trainer.engine.checkpoint_files import checkpoint_damage, checkpoint_name, complete_checkpoints, resolve_resume, write_manifest

CADENCE = ["data.loader.batch_size=64", "optim.epochs=4", "optim.warmup_epochs=1", "checkpoint.every_steps=2",
           "logging.log_every=1", "logging.consumed_ids=true"]
FOUR_STEPS = CADENCE + ["max_steps=4"]
KILLED_AT = re.compile(r"fail point \S+ \(step \d+\): killing rank \d+ with SIGKILL at (\d+\.\d+)")
NO_LOSS = "none: bit-identical to the uninterrupted run"


@dataclass
class DrillResult:
    name: str
    fault: str
    outcome: str
    data_lost: str
    recovery_s: float | None  # from the fault to the first training step after it (or to the clean exit)
    passed: bool


class DrillContext:
    """Shared inputs of the drills, built on first use under ``work_dir``: the digits split, an
    uninterrupted 4-step run, and a run stopped after its step-2 checkpoint."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = Path(work_dir)

    def directory(self, name: str) -> Path:
        path = self.work_dir / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    @cached_property
    def shards(self) -> dict[str, Path]:
        root = self.work_dir / "digits"
        if not (root / "val" / "manifest.json").exists():
            shutil.rmtree(root, ignore_errors=True)
            for split in ("train", "val"):
                write_shards(sklearn_digits(32, split=split), root / split,
                             ShardSettings(prefix=split, samples_per_shard=256), progress=False)
        return {"train": root / "train", "val": root / "val"}

    def _finished_job(self, name: str, overrides: list[str]) -> Job:
        job = Job(self.directory(name), self.shards)
        result = job.run(overrides, resume="none")
        if result.returncode != 0:
            raise RuntimeError(f"the drills' {name} run failed:\n{result.stderr[-3000:]}")
        return job

    @cached_property
    def reference(self) -> Path:
        """The final checkpoint of 4 steps never interrupted."""
        return complete_checkpoints(self._finished_job("uninterrupted", FOUR_STEPS).checkpoints)[-1]

    @cached_property
    def after_two_steps(self) -> Job:
        return self._finished_job("after-two-steps", CADENCE + ["max_steps=2"])


def _killed_at(output: str) -> float | None:
    found = KILLED_AT.search(output)
    return float(found.group(1)) if found else None


def _first_step_after(job: Job, moment: float | None) -> float | None:
    if moment is None:
        return None
    steps = [r["time"] for r in job.log_records() if r.get("event") == "step" and r["time"] > moment]
    return round(steps[0] - moment, 1) if steps else None


def _resume_and_compare(job: Job, context: DrillContext, fault_time: float | None) -> tuple[str, float | None, bool]:
    resumed = job.run(FOUR_STEPS)
    if resumed.returncode != 0:
        return f"the resume failed: {resumed.stderr[-300:]}", None, False
    difference = state_difference(complete_checkpoints(job.checkpoints)[-1], context.reference)
    return difference or NO_LOSS, _first_step_after(job, fault_time), difference is None


def rank_killed_mid_step(context: DrillContext) -> DrillResult:
    job = Job(context.directory("rank-killed-mid-step"), context.shards)
    result = job.run(FOUR_STEPS, resume="auto", launcher=[*LAUNCH, "--max-restarts=1"],
                     env=job_env(INSTCLS_FAILPOINT="train.after_backward,rank=1,step=3"))
    killed = _killed_at(result.stdout + result.stderr)
    resumed = f"resumed from {job.checkpoints / checkpoint_name(2)}" in result.stdout + result.stderr
    difference = state_difference(complete_checkpoints(job.checkpoints)[-1], context.reference) \
        if complete_checkpoints(job.checkpoints) else "no checkpoint at all"
    accounting, counted = accounting_difference(job.run_dir, context.reference.parent.parent)
    return DrillResult(
        "rank-killed-mid-step", "SIGKILL of rank 1 in step 3 (torchrun --max-restarts=1)",
        f"exit {result.returncode}; torchrun restarted both ranks, " + ("they resumed step 2" if resumed else
                                                                          "no resume logged") + " and finished; "
        + (accounting or f"each of the {counted} ids of steps 1-4 consumed once, as uninterrupted"),
        difference or accounting or NO_LOSS, _first_step_after(job, killed),
        result.returncode == 0 and killed is not None and resumed and difference is None and accounting is None)


def killed_during_save(context: DrillContext, fault: str, completes: bool, run_dir: Path) -> DrillResult:
    """SIGKILL at fail point ``fault`` (``NAME,rank=R``) while checkpoint 4 is written, then resume.
    ``completes``: the kill comes after the rename, so checkpoint 4 is the complete one to take."""
    job = context.after_two_steps.copy_to(run_dir)
    killed = job.run(FOUR_STEPS, launcher=LAUNCH, env=job_env(INSTCLS_FAILPOINT=f"{fault},step=4"))
    killed_at = _killed_at(killed.stdout + killed.stderr)
    expected = job.checkpoints / checkpoint_name(4 if completes else 2)
    picked = resolve_resume("auto", job.checkpoints, log=lambda message: None)
    partial = (job.checkpoints / (checkpoint_name(4) + ".tmp")).exists()
    newest_is_expected = complete_checkpoints(job.checkpoints)[-1] == expected and checkpoint_damage(expected) is None
    lost, recovery, same = _resume_and_compare(job, context, killed_at)
    leftover = bool(list(job.checkpoints.glob("*.tmp")))
    return DrillResult(
        "rank-killed-while-saving", f"SIGKILL at {fault} while checkpoint 4 is written",
        f"exit {killed.returncode}; step 4 left as .tmp: {partial}; --resume auto took {picked.name if picked else None}; "
        f"partial files left after the resume: {leftover}", lost, recovery,
        killed.returncode != 0 and killed_at is not None and partial != completes and picked == expected
        and newest_is_expected and not leftover and same)


def rank_killed_while_saving(context: DrillContext) -> DrillResult:
    """Rank 1 dies after writing its DeepSpeed files of checkpoint 4, before the rest."""
    return killed_during_save(context, "checkpoint.after_engine,rank=1", False,
                              context.directory("rank-killed-while-saving"))


def damaged_newest_checkpoint(context: DrillContext) -> DrillResult:
    job = Job(context.directory("damaged-newest-checkpoint"), context.shards)
    shutil.copytree(context.reference.parent.parent, job.run_dir, dirs_exist_ok=True)
    damaged = complete_checkpoints(job.checkpoints)[-1] / "model.pt"
    with open(damaged, "r+b") as file:
        file.truncate(damaged.stat().st_size // 2)
    found_at = time.time()
    lost, recovery, same = _resume_and_compare(job, context, found_at)
    said = any("is damaged" in r.get("message", "") for r in job.log_records())
    return DrillResult(
        "damaged-newest-checkpoint", "newest checkpoint's model.pt truncated to half",
        f"damage {'reported by file' if said else 'not reported'}; resumed from the checkpoint before it",
        lost, recovery, said and same)


@contextmanager
def taken_port():
    """A TCP port held by a listening socket for the duration of the block."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _limit_file_size() -> None:
    # A write past the limit fails with EFBIG as one to a full disk fails with ENOSPC: same path.
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def disk_full_during_save(context: DrillContext) -> DrillResult:
    job = context.after_two_steps.copy_to(context.directory("disk-full-during-save"))
    failed = job.run(FOUR_STEPS, launcher=LAUNCH, preexec_fn=_limit_file_size)
    failed_at = time.time()
    named = "could not write checkpoint" in failed.stderr and "bytes" in failed.stderr
    traceback = 'trainer/engine/checkpoint.py", line' in failed.stderr
    previous = complete_checkpoints(job.checkpoints)[-1]
    intact = previous.name == checkpoint_name(2) and checkpoint_damage(previous) is None
    lost, recovery, same = _resume_and_compare(job, context, failed_at)
    return DrillResult(
        "disk-full-during-save", "every file write over 1 MiB fails (EFBIG) while checkpoint 4 is saved",
        f"exit {failed.returncode}; error names path and bytes: {named}; traceback: {traceback}; "
        f"{previous.name} intact: {intact}", lost, recovery,
        failed.returncode != 0 and named and not traceback and intact and same)


def preempted_with_sigterm(context: DrillContext) -> DrillResult:
    job = Job(context.directory("preempted-with-sigterm"), context.shards)
    process = subprocess.Popen(job.command(CADENCE + ["optim.epochs=50", "logging.log_every=1"], resume="none",
                                           launcher=LAUNCH),
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env())
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if sum(r.get("event") == "step" for r in job.log_records()) >= 3:
            break
        time.sleep(0.2)
    signalled = time.time()
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    exited = round(time.time() - signalled, 1)
    saved = complete_checkpoints(job.checkpoints)
    complete = bool(saved) and checkpoint_damage(saved[-1]) is None and "SIGTERM: saving at step" in output
    return DrillResult(
        "preempted-with-sigterm", "SIGTERM to `instcls launch` (what Kubernetes sends a pod)",
        f"exit {process.returncode}; {saved[-1].name if saved else 'no checkpoint'} complete; "
        f"saved and exited {exited} s after the signal", "none: the run resumes from that step", exited,
        process.returncode == 0 and complete)


def loss_becomes_nan(context: DrillContext) -> DrillResult:
    job = context.after_two_steps.copy_to(context.directory("loss-becomes-nan"))
    result = job.run(CADENCE + ["optim.base_lr=1e30", "logging.log_every=1", "checkpoint.every_steps=1"])
    stopped = "became NaN or inf by step" in result.stderr
    newest = complete_checkpoints(job.checkpoints)[-1]
    finite = all(t.isfinite().all() for t in torch.load(newest / "model.pt", weights_only=True).values())
    return DrillResult(
        "loss-becomes-nan", "optim.base_lr=1e30: the loss and weights overflow",
        f"exit {result.returncode}; stopped with the step and the last good checkpoint named: {stopped}; newest "
        f"checkpoint {newest.name} finite: {finite}", "none: nothing non-finite was saved", None,
        result.returncode != 0 and stopped and finite)


def nan_step_skipped(context: DrillContext) -> DrillResult:
    job = Job(context.directory("nan-step-skipped"), context.shards)
    result = job.run(FOUR_STEPS + ["optim.on_nonfinite=skip_step", "checkpoint.every_steps=1", "checkpoint.keep=9"],
                     resume="none", env=job_env(INSTCLS_FAILPOINT="train.nan_features,rank=1,step=3"))
    skipped = [[r["step"] for r in job.log_records(rank) if r.get("event") == "nonfinite_step_skipped"] for rank in (0, 1)]
    saved = {path.name for path in complete_checkpoints(job.checkpoints)}
    steps = [checkpoint_name(step) for step in (2, 3, 4)]
    difference = (state_difference(job.checkpoints / steps[1], job.checkpoints / steps[0], same_step=False)
                  if set(steps) <= saved else f"checkpoints {sorted(saved)}, not those of steps 2-4")
    return DrillResult(
        "nan-step-skipped", "rank 1's features NaN at step 3, optim.on_nonfinite: skip_step",
        f"exit {result.returncode}; step skipped on ranks 0/1: {skipped}; state after it vs before: "
        f"{difference or 'bit-identical'}; {len(saved)} checkpoints to step 4",
        "none: the model is exactly as before the bad step (its batch is not trained on, by policy)", None,
        result.returncode == 0 and skipped == [[3], [3]] and difference is None)


def metrics_port_taken(context: DrillContext) -> DrillResult:
    job = Job(context.directory("metrics-port-taken"), context.shards)
    with taken_port() as port:
        started = time.time()
        result = job.run(FOUR_STEPS + [f"logging.metrics_port={port}"], resume="none")
        seconds = round(time.time() - started, 1)
    named = f":{port}, the port is in use" in result.stderr
    return DrillResult(
        "metrics-port-taken", f"logging.metrics_port {port} already bound on the node",
        f"exit {result.returncode} after {seconds} s, before any step; the error names the port: {named}",
        "none: no step ran", None,
        result.returncode != 0 and named and not any(r.get("event") == "step" for r in job.log_records()))


def rendezvous_port_taken(context: DrillContext) -> DrillResult:
    job = Job(context.directory("rendezvous-port-taken"), context.shards)
    with taken_port() as port:
        command = job.command(FOUR_STEPS, resume="none", launcher=LAUNCH)
        command[command.index("--master-port") + 1] = str(port)
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=job_env())
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    advised = "rendezvous port is taken" in last
    return DrillResult(
        "rendezvous-port-taken", f"--master-port {port} already bound",
        f"exit {result.returncode}; last line says what to change: {advised}", "none: no step ran", None,
        result.returncode != 0 and advised)


class TouchesAFile:
    """Unpickled with ``weights_only=False`` it creates ``marker``: code run by loading a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def checkpoint_with_pickled_code(context: DrillContext) -> DrillResult:
    job = context.after_two_steps.copy_to(context.directory("checkpoint-with-pickled-code"))
    checkpoint = complete_checkpoints(job.checkpoints)[-1]
    marker = job.run_dir / "code-ran"
    tampered = checkpoint / "components" / "objective" / "rank-00000.pt"
    state = torch.load(tampered, weights_only=True)
    torch.save(dict(state, payload=TouchesAFile(marker)), tampered)
    write_manifest(checkpoint)  # an attacker who can write the volume can rewrite the manifest too
    result = job.run(FOUR_STEPS)
    refused = re.search(r"instcls: error: \S+rank-00000\.pt: refusing to load it", result.stderr) is not None
    return DrillResult(
        "checkpoint-with-pickled-code", "a checkpoint file rewritten to run code when unpickled (manifest too)",
        f"exit {result.returncode}; refused by file name: {refused}; the code ran: {marker.exists()}",
        "none: the checkpoint is left for inspection", None,
        result.returncode != 0 and refused and not marker.exists())


def _job_with_a_damaged_shard(context: DrillContext, name: str) -> tuple[Job, Path]:
    """A job whose training shards have their last tar cut to a third (after validation, as a
    failing disk or a partial copy would)."""
    job = Job(context.directory(name), context.shards)
    job.shards = dict(context.shards, train=job.run_dir / "train-shards")
    shutil.copytree(context.shards["train"], job.shards["train"])
    tar = sorted(job.shards["train"].glob("*.tar"))[-1]
    with open(tar, "r+b") as file:
        file.truncate(tar.stat().st_size // 3)
    return job, tar


def shard_damaged_mid_run(context: DrillContext) -> DrillResult:
    job, tar = _job_with_a_damaged_shard(context, "shard-damaged-mid-run")
    started = time.time()
    result = job.run(FOUR_STEPS, resume="none", timeout=300)
    seconds = round(time.time() - started, 1)
    named = re.search(rf"instcls: error: {re.escape(tar.name)} key \d+", result.stderr) is not None
    traceback = 'sample_table.py", line' in result.stderr
    return DrillResult(
        "shard-damaged-mid-run", f"{tar.name} truncated to a third after validation",
        f"exit {result.returncode} after {seconds} s (no hang); one line names shard and key: {named}; "
        f"traceback: {traceback}", "none: nothing was saved from a step that lacked its samples", None,
        result.returncode != 0 and named and not traceback)


def shard_damaged_skipped(context: DrillContext) -> DrillResult:
    job, tar = _job_with_a_damaged_shard(context, "shard-damaged-skipped")
    result = job.run(FOUR_STEPS + ["data.loader.on_bad_sample=skip"], resume="none")
    skipped = [r for rank in range(job.nproc) for r in job.log_records(rank) if r.get("event") == "bad_sample_skipped"]
    named = bool(skipped) and all(r["problem"].startswith(f"{tar.name} key ") for r in skipped)
    losses = [r["loss"] for r in job.log_records() if r.get("event") == "step"]
    finished = result.returncode == 0 and bool(complete_checkpoints(job.checkpoints))
    return DrillResult(
        "shard-damaged-skipped", f"{tar.name} cut to a third, with data.loader.on_bad_sample=skip",
        f"exit {result.returncode}; trained to the end; each skipped sample named by shard and key: {named}; "
        f"losses finite: {all(math.isfinite(v) for v in losses)}",
        f"the {len(skipped)} unreadable samples (weighed zero in their steps, counted in "
        "instcls_bad_samples_skipped_total)", None,
        finished and named and bool(losses) and all(math.isfinite(v) for v in losses))


DRILLS: dict[str, Callable[[DrillContext], DrillResult]] = {
    "rank-killed-mid-step": rank_killed_mid_step,
    "rank-killed-while-saving": rank_killed_while_saving,
    "damaged-newest-checkpoint": damaged_newest_checkpoint,
    "disk-full-during-save": disk_full_during_save,
    "preempted-with-sigterm": preempted_with_sigterm,
    "loss-becomes-nan": loss_becomes_nan,
    "nan-step-skipped": nan_step_skipped,
    "metrics-port-taken": metrics_port_taken,
    "rendezvous-port-taken": rendezvous_port_taken,
    "checkpoint-with-pickled-code": checkpoint_with_pickled_code,
    "shard-damaged-mid-run": shard_damaged_mid_run,
    "shard-damaged-skipped": shard_damaged_skipped,
}
