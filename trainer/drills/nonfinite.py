"""Drills where the loss goes NaN or inf: the job stops with nothing non-finite saved, or (under
``optim.on_nonfinite: skip_step``) drops exactly the bad step."""

from __future__ import annotations

import torch

from trainer.checkpoint.checkpoint_files import checkpoint_name, complete_checkpoints
from trainer.drills.context import CADENCE, FOUR_STEPS, DrillContext, DrillResult
from trainer.drills.jobs import LAUNCH, Job, job_env, state_difference
from trainer.exit_codes import ExitCode


def loss_becomes_nan(context: DrillContext) -> DrillResult:
    job = context.after_two_steps.copy_to(context.directory("loss-becomes-nan"))
    result = job.run(CADENCE + ["optim.base_lr=1e30", "logging.log_every=1", "checkpoint.every_steps=1"],
                     launcher=LAUNCH)
    stopped = "became NaN or inf by step" in result.stderr
    newest = complete_checkpoints(job.checkpoints)[-1]
    finite = all(t.isfinite().all() for t in torch.load(newest / "model.pt", weights_only=True).values())
    return DrillResult(
        "loss-becomes-nan", "optim.base_lr=1e30: the loss and weights overflow",
        f"exit {result.returncode}; stopped with the step and the last good checkpoint named: {stopped}; newest "
        f"checkpoint {newest.name} finite: {finite}", "none: nothing non-finite was saved", None,
        result.returncode == ExitCode.NONFINITE_LOSS and stopped and finite)


def nan_step_skipped(context: DrillContext) -> DrillResult:
    job = Job(context.directory("nan-step-skipped"), context.shards)
    result = job.run(FOUR_STEPS + ["optim.on_nonfinite=skip_step", "checkpoint.every_steps=1", "checkpoint.keep=9"],
                     resume="none", env=job_env(INSTCLS_FAILPOINT="train.nan_features,rank=1,step=3"))
    skipped = [
        [r["step"] for r in job.log_records(rank) if r.get("event") == "nonfinite_step_skipped"] for rank in (0, 1)
    ]
    saved = {path.name for path in complete_checkpoints(job.checkpoints)}
    steps = [checkpoint_name(step) for step in (2, 3, 4)]
    difference = (
        state_difference(job.checkpoints / steps[1], job.checkpoints / steps[0], same_step=False)
        if set(steps) <= saved
        else f"checkpoints {sorted(saved)}, not those of steps 2-4"
    )
    return DrillResult(
        "nan-step-skipped",
        "rank 1's features NaN at step 3, optim.on_nonfinite: skip_step",
        f"exit {result.returncode}; step skipped on ranks 0/1: {skipped}; state after it vs before: "
        f"{difference or 'bit-identical'}; {len(saved)} checkpoints to step 4",
        "none: the model is exactly as before the bad step (its batch is not trained on, by policy)",
        None,
        result.returncode == 0 and skipped == [[3], [3]] and difference is None,
    )
