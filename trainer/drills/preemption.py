"""Drills that stop a job with SIGTERM, as Kubernetes does: the job must exit with the retryable code
after a complete checkpoint, and the same command must then resume it to exactly the uninterrupted
state.  Rank 0 waits after step 2's backward until it has the signal (``train.wait_for_sigterm``),
so the signal lands mid-run however fast the machine is."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from trainer.checkpoint.checkpoint_files import complete_checkpoints
from trainer.drills.context import (
    FOUR_STEPS,
    NO_LOSS,
    DrillContext,
    DrillResult,
    recovery_time,
    sigterm_checkpoint,
)
from trainer.drills.jobs import LAUNCH, REPO, Job, job_env, state_difference
from trainer.exit_codes import ExitCode


def _stopped_by_sigterm(job: Job, launcher: list[str], signal_rank_only: bool) -> tuple[list[str], dict]:
    """Start the 4-step job and SIGTERM it once rank 0 waits after step 2's backward (the signal then
    lands mid-run however fast the machine is): to `instcls launch`, or to rank 0 alone.  Returns the
    command and what happened: the output, the exit code, when the signal was sent and how long the
    job took to exit after it."""
    command = job.command(FOUR_STEPS, resume="auto", launcher=launcher)  # --resume auto, as in k8s/
    env = job_env(INSTCLS_FAILPOINT="train.wait_for_sigterm,rank=0,step=2")
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, waiting = [], None
    for line in process.stdout:
        lines.append(line)
        if (waiting := re.search(r"fail point train\.wait_for_sigterm .* \(pid (\d+)\) waits", line)):
            break
    signalled = time.time()
    if signal_rank_only and waiting:
        os.kill(int(waiting.group(1)), signal.SIGTERM)
    else:
        process.send_signal(signal.SIGTERM)
    output = "".join(lines) + process.communicate(timeout=600)[0]
    return command, dict(output=output, code=process.returncode, signalled=signalled, env=env,
                         exited=round(time.time() - signalled, 1))


def preempted_with_sigterm(context: DrillContext) -> DrillResult:
    """SIGTERM to `instcls launch` mid-run, as Kubernetes sends it to a pod: a complete checkpoint and
    the retryable exit code.  Then the same command again, as the Job's replacement pod runs it:
    it resumes and ends bit-identical to the uninterrupted run, exit 0."""
    job = Job(context.directory("preempted-with-sigterm"), context.shards)
    command, stop = _stopped_by_sigterm(job, LAUNCH, signal_rank_only=False)
    stopped_at = sigterm_checkpoint(job, stop["output"])
    if stopped_at is not None and complete_checkpoints(job.checkpoints)[-1] != stopped_at:
        stopped_at = None  # the run went on past its SIGTERM checkpoint
    relaunched = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=stop["env"])
    resumed = stopped_at is not None and f"resumed from {stopped_at}" in relaunched.stdout + relaunched.stderr
    difference = state_difference(complete_checkpoints(job.checkpoints)[-1], context.reference) \
        if complete_checkpoints(job.checkpoints) else "no checkpoint at all"
    return DrillResult(
        "preempted-with-sigterm", "SIGTERM to `instcls launch` mid-run (what Kubernetes sends a pod), then the "
        "same command again",
        f"exit {stop['code']} (retryable: {stop['code'] == ExitCode.PREEMPTED}) {stop['exited']} s after the signal; "
        f"complete SIGTERM checkpoint: {stopped_at.name if stopped_at else None}; the same command resumed from it: "
        f"{resumed}, exit {relaunched.returncode}", difference or NO_LOSS,
        recovery_time(job, stop["signalled"]),
        stop["code"] == ExitCode.PREEMPTED and stopped_at is not None and resumed
        and relaunched.returncode == ExitCode.FINISHED and difference is None)


def peer_preempted(context: DrillContext) -> DrillResult:
    """SIGTERM to rank 0 alone, as when another node's pod is preempted: this node's ranks stop at the
    agreed step too and exit 143, and its torchrun (``--max-restarts=1``) restarts them in place
    instead of taking 143 for the end of the run; they resume and finish bit-identical, exit 0."""
    job = Job(context.directory("peer-preempted"), context.shards)
    _, stop = _stopped_by_sigterm(job, [*LAUNCH, "--max-restarts=1"], signal_rank_only=True)
    stopped_at = sigterm_checkpoint(job, stop["output"])
    retryable = re.search(r"stopped \(sigterm\) .* exiting 143", stop["output"]) is not None  # not taken for done
    resumed = stopped_at is not None and f"resumed from {stopped_at}" in stop["output"]
    difference = state_difference(complete_checkpoints(job.checkpoints)[-1], context.reference) \
        if complete_checkpoints(job.checkpoints) else "no checkpoint at all"
    return DrillResult(
        "peer-preempted", "SIGTERM to rank 0 only (another node's pod preempted), `instcls launch --max-restarts=1`",
        f"complete SIGTERM checkpoint: {stopped_at.name if stopped_at else None}; the ranks exited 143: {retryable}; "
        f"torchrun restarted them in place and they resumed from it: {resumed}; exit {stop['code']}",
        difference or NO_LOSS, recovery_time(job, stop["signalled"]),
        stopped_at is not None and retryable and resumed and stop["code"] == ExitCode.FINISHED and difference is None)
