"""How the elastic drills (``overlay_drills``: a two-node job launched with ``--nnodes 1:2`` loses a
node for good and goes on with the one it has, then gets it back and grows again) are judged.

What is compared with the uninterrupted 2-node run over the same samples in the same order:

* the steps before the loss: bit-identical losses (the same 2 ranks ran them);
* the samples of every step: each id consumed once, at the same step (the global batch is kept:
  1 rank x 128 = 2 x 64, and the sampler's order does not depend on the world size);
* the learning rate of every step: identical (the schedule depends on the global batch only);
* the first step after the loss: the same loss to the log's precision (the same weights, samples
  and views, whose augmentation is keyed by sample, not by rank; SyncBatchNorm normalises over the
  global batch however it is split);
* the steps after it: within ``LOSS_TOLERANCE``.  Not exact: the classifier sums its softmax over
  one shard of rows instead of two, and SyncBatchNorm reduces over one rank instead of two, in
  other rounding orders, and a few steps of this small-batch network amplify the rounding.  (With
  local BatchNorm the one rank would normalise over 128 images where two did over 64 each; the
  drills train with SyncBatchNorm to leave that out);
* the state every rank must hold alike (BatchNorm statistics, the objective's replicated buffers):
  alike on both ranks at the save after the job grew back.
"""

from __future__ import annotations

from trainer.drills.context import CADENCE, DrillContext
from trainer.drills.jobs import Job, final_run_records
from trainer.observability.report import RunLogs

# The first step after the change: its loss as the log rounds it (5 decimals), give or take one digit.
FIRST_STEP_TOLERANCE = 2e-5
# Relative difference of a later step's loss from the uninterrupted run's.  Measured on the digits
# (2026-11-28): 1.3e-4 one step on, at most 9.9e-4 over the 3 steps after; 5x that.  A resume with
# rows in the wrong place, other samples or another learning rate is caught exactly (ids, lr).
LOSS_TOLERANCE = 5e-3
# SyncBatchNorm: statistics of the global batch however it is split, so that what the curves may
# differ by is rounding (another reduction order), not the per-rank batch's own statistics.
ELASTIC = CADENCE + ["model.batch_norm=sync"]
FOUR_STEPS = ELASTIC + ["max_steps=4"]
SIX_STEPS = ELASTIC + ["max_steps=6"]
# node-returns: the save its return triggers outlasts torch's fixed 30 s, inside the agents' shutdown
# timeout (the overlays' grace period less 30 s)
SLOW_SAVE_S = 40


def loss_curve(job: Job) -> dict[int, float]:
    """step -> the job's loss at it: the mean of its ranks' losses (each over its equal share of the
    global batch), from the last run that trained it."""
    return {step: sum(r["loss"] for r in by_rank.values()) / len(by_rank)
            for step, by_rank in final_run_records(job.run_dir, "step").items()}


def lr_curve(job: Job) -> dict[int, float]:
    """step -> its learning rate (the lowest rank's: every rank logs the same schedule), from the last run."""
    return {step: by_rank[min(by_rank)]["lr"] for step, by_rank in final_run_records(job.run_dir, "step").items()}


def restarts(job: Job) -> list[dict]:
    return [r for r in job.log_records() if r.get("event") == "restart"]


def compare_curves(mine: Job, reference: Job, exact_until: int) -> tuple[str | None, str]:
    """``(problem or None, summary)``: losses equal up to step ``exact_until``, the next one's to the
    log's precision, the later ones within the tolerance; learning rates equal throughout."""
    losses, theirs = loss_curve(mine), loss_curve(reference)
    if sorted(losses) != sorted(theirs):
        return f"steps logged {sorted(losses)}, uninterrupted {sorted(theirs)}", ""
    if lr_curve(mine) != lr_curve(reference):
        return "the learning rate differs from the uninterrupted run's", ""
    differing = [step for step in losses if step <= exact_until and losses[step] != theirs[step]]
    if differing:
        return f"the losses of steps {differing}, before the change, differ from the uninterrupted run's", ""
    first = exact_until + 1
    if abs(losses[first] - theirs[first]) > FIRST_STEP_TOLERANCE:
        return (f"step {first}, the first after the change, has loss {losses[first]} where the uninterrupted run "
                f"has {theirs[first]}", "")
    relative = {step: abs(losses[step] - theirs[step]) / abs(theirs[step]) for step in losses if step > first}
    worst = max(relative, key=relative.get)
    summary = (f"losses of steps 1-{exact_until} identical, of step {first} equal to the log's 5 decimals, after: "
               f"at most {relative[worst]:.1e} relative (step {worst}; tolerance {LOSS_TOLERANCE:.0e}); learning "
               "rates identical")
    if relative[worst] > LOSS_TOLERANCE:
        return f"step {worst}'s loss differs by {relative[worst]:.1e} relative (> {LOSS_TOLERANCE:.0e})", summary
    return None, summary


def uninterrupted_job(context: DrillContext, name: str, overrides: list[str]) -> Job:
    """The never-interrupted run of ``overrides`` that an elastic drill is compared with, run once per
    work directory."""
    job = Job(context.work_dir / name, context.shards)
    if not list((job.run_dir / "logs").glob("rank-*.jsonl")) or not loss_curve(job):
        job = context._finished_job(name, overrides)
    return job


def replicated_difference(job: Job, step: int) -> str | None:
    """None when every rank's check at ``step``'s save found the state all ranks hold alike alike."""
    logs = RunLogs.read(job.run_dir / "logs")
    checks = [r for rank in logs.by_rank for r in logs.events("replicated", rank) if r.get("step") == step]
    if len(checks) != 2 or not all(c["entries"] for c in checks):
        return f"{len(checks)} ranks checked their replicated state at step {step}'s save, not 2"
    diverged = sorted({entry for c in checks for entry in c["diverged"]})
    return f"replicated state differs across the ranks: {diverged[:5]}" if diverged else None
