"""Drills that crash a job (a rank killed mid-step or mid-save, a damaged newest checkpoint, a full
disk) and check that it resumes to exactly the uninterrupted state."""

from __future__ import annotations

import resource
import shutil
import time
from pathlib import Path

from trainer.checkpoint.checkpoint_files import checkpoint_damage, checkpoint_name, complete_checkpoints, resolve_resume
from trainer.drills.context import (
    FOUR_STEPS,
    NO_LOSS,
    DrillContext,
    DrillResult,
    first_step_after,
    killed_at,
    resume_and_compare,
)
from trainer.drills.jobs import LAUNCH, Job, accounting_difference, job_env, state_difference
from trainer.exit_codes import ExitCode


def rank_killed_mid_step(context: DrillContext) -> DrillResult:
    job = Job(context.directory("rank-killed-mid-step"), context.shards)
    result = job.run(FOUR_STEPS, resume="auto", launcher=[*LAUNCH, "--max-restarts=1"],
                     env=job_env(INSTCLS_FAILPOINT="train.after_backward,rank=1,step=3"))
    killed = killed_at(result.stdout + result.stderr)
    resumed = f"resumed from {job.checkpoints / checkpoint_name(2)}" in result.stdout + result.stderr
    difference = state_difference(complete_checkpoints(job.checkpoints)[-1], context.reference) \
        if complete_checkpoints(job.checkpoints) else "no checkpoint at all"
    accounting, counted = accounting_difference(job.run_dir, context.reference.parent.parent)
    return DrillResult(
        "rank-killed-mid-step", "SIGKILL of rank 1 in step 3 (torchrun --max-restarts=1)",
        f"exit {result.returncode}; torchrun restarted both ranks, " + ("they resumed step 2" if resumed else
                                                                          "no resume logged") + " and finished; "
        + (accounting or f"each of the {counted} ids of steps 1-4 consumed once, as uninterrupted"),
        difference or accounting or NO_LOSS, first_step_after(job, killed),
        result.returncode == 0 and killed is not None and resumed and difference is None and accounting is None)


def killed_during_save(context: DrillContext, fault: str, completes: bool, run_dir: Path) -> DrillResult:
    """SIGKILL at fail point ``fault`` (``NAME,rank=R``) while checkpoint 4 is written, then resume.
    ``completes``: the kill comes after the rename, so checkpoint 4 is the complete one to take."""
    job = context.after_two_steps.copy_to(run_dir)
    killed = job.run(FOUR_STEPS, launcher=LAUNCH, env=job_env(INSTCLS_FAILPOINT=f"{fault},step=4"))
    kill_time = killed_at(killed.stdout + killed.stderr)
    expected = job.checkpoints / checkpoint_name(4 if completes else 2)
    picked = resolve_resume("auto", job.checkpoints, log=lambda message: None)
    partial = (job.checkpoints / (checkpoint_name(4) + ".tmp")).exists()
    newest_is_expected = complete_checkpoints(job.checkpoints)[-1] == expected and checkpoint_damage(expected) is None
    lost, recovery, same = resume_and_compare(job, context, kill_time)
    leftover = bool(list(job.checkpoints.glob("*.tmp")))
    return DrillResult(
        "rank-killed-while-saving",
        f"SIGKILL at {fault} while checkpoint 4 is written",
        f"exit {killed.returncode}; step 4 left as .tmp: {partial}; "
        f"--resume auto took {picked.name if picked else None}; "
        f"partial files left after the resume: {leftover}",
        lost,
        recovery,
        killed.returncode == ExitCode.CRASHED
        and kill_time is not None
        and partial != completes
        and picked == expected
        and newest_is_expected
        and not leftover
        and same,
    )


def rank_killed_while_saving(context: DrillContext) -> DrillResult:
    """Rank 1 dies after writing its DeepSpeed files of checkpoint 4, before the rest."""
    return killed_during_save(
        context, "checkpoint.after_engine,rank=1", False, context.directory("rank-killed-while-saving")
    )


def damaged_newest_checkpoint(context: DrillContext) -> DrillResult:
    job = Job(context.directory("damaged-newest-checkpoint"), context.shards)
    shutil.copytree(context.reference.parent.parent, job.run_dir, dirs_exist_ok=True)
    damaged = complete_checkpoints(job.checkpoints)[-1] / "model.pt"
    with open(damaged, "r+b") as file:
        file.truncate(damaged.stat().st_size // 2)
    found_at = time.time()
    lost, recovery, same = resume_and_compare(job, context, found_at)
    said = any("is damaged" in r.get("message", "") for r in job.log_records())
    return DrillResult(
        "damaged-newest-checkpoint",
        "newest checkpoint's model.pt truncated to half",
        f"damage {'reported by file' if said else 'not reported'}; resumed from the checkpoint before it",
        lost,
        recovery,
        said and same,
    )


def _limit_file_size() -> None:
    # A write past the limit fails with EFBIG as one to a full disk fails with ENOSPC: same path.
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def disk_full_during_save(context: DrillContext) -> DrillResult:
    job = context.after_two_steps.copy_to(context.directory("disk-full-during-save"))
    failed = job.run(FOUR_STEPS, launcher=LAUNCH, preexec_fn=_limit_file_size)
    failed_at = time.time()
    named = "could not write checkpoint" in failed.stderr and "bytes" in failed.stderr
    traceback = 'trainer/checkpoint/components.py", line' in failed.stderr
    previous = complete_checkpoints(job.checkpoints)[-1]
    intact = previous.name == checkpoint_name(2) and checkpoint_damage(previous) is None
    lost, recovery, same = resume_and_compare(job, context, failed_at)
    return DrillResult(
        "disk-full-during-save",
        "every file write over 1 MiB fails (EFBIG) while checkpoint 4 is saved",
        f"exit {failed.returncode}; error names path and bytes: {named}; traceback: {traceback}; "
        f"{previous.name} intact: {intact}",
        lost,
        recovery,
        failed.returncode == ExitCode.CHECKPOINT_WRITE_FAILED and named and not traceback and intact and same,
    )
