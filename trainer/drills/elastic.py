"""Elastic drills: a two-node job launched with ``--nnodes 1:2`` loses a node for good and goes on
with the one it has, then gets it back and grows again.

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

import time

from trainer.checkpoint.checkpoint_files import checkpoint_name
from trainer.drills.context import CADENCE, DrillContext, DrillResult, recovery_time
from trainer.drills.jobs import Job, accounting_difference, final_run_records
from trainer.drills.node_faults import WAITS, _held, _lose_mid_step
from trainer.drills.two_nodes import VOLUMES, TwoNodeJob
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
# A round that has its one required node waits this long for the other: longer than an agent takes
# to start here (imports, ~10 s on 2 busy cores), so both nodes start the job together.
LAST_CALL_S = 20
# node-returns: the save its return triggers outlasts torch's fixed 30 s, inside the agents' timeout
SLOW_SAVE_S, SHUTDOWN_TIMEOUT_S = 40, 120


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


def _uninterrupted(context: DrillContext, name: str, overrides: list[str]) -> Job:
    job = Job(context.work_dir / name, context.shards)
    if not list((job.run_dir / "logs").glob("rank-*.jsonl")) or not loss_curve(job):
        job = context._finished_job(name, overrides)
    return job


def node_lost_for_good(context: DrillContext) -> DrillResult:
    """Node 1's agent and worker SIGKILLed in step 3, never replaced.  Node 0's agent restarts its
    rank into the next rendezvous round, which completes with one node; it resumes the step-2
    checkpoint on 1 rank with the same global batch and finishes."""
    reference = _uninterrupted(context, "uninterrupted-sync-4", FOUR_STEPS)
    with TwoNodeJob(context.directory("node-lost-for-good"), context.shards, overrides=list(FOUR_STEPS), min_nodes=1,
                    last_call_s=LAST_CALL_S) as job:
        survivor, victim = job.start(0), job.start(1, _held(3))
        fault = _lose_mid_step(job, victim)
        code = job.wait([survivor])[0]
    record = (restarts(job.job) or [{}])[-1]
    accounting, counted = accounting_difference(job.shared, reference.run_dir)
    curves, summary = compare_curves(job.job, reference, exact_until=2)
    shrunk = record.get("previous_world_size") == 2 and record.get("world_size") == 1
    resumed = f"resumed from {VOLUMES}/checkpoints/{checkpoint_name(2)}" in job.output()
    return DrillResult(
        "node-lost-for-good", "node 1's agent and worker SIGKILLed in step 3, no replacement (--nnodes 1:2)",
        f"node 0 exited {code}; it went on alone from the step-2 checkpoint: {shrunk and resumed} "
        f"({record.get('steps_lost')} steps lost, training stood still {record.get('stopped_seconds')} s); "
        + (accounting or f"each of the {counted} ids of steps 1-4 consumed once, at the same step") + f"; {summary}",
        curves or accounting or f"none: every id consumed once; {record.get('steps_lost')} steps trained again",
        recovery_time(job.job, fault) if fault else None,
        fault is not None and code == 0 and shrunk and resumed and accounting is None and curves is None)


def node_returns(context: DrillContext) -> DrillResult:
    """As node-lost-for-good, 6 steps; node 0, alone, is held in step 4 until node 1 comes back.
    Its agent then stops its rank for the new member (SIGTERM: the rank saves where it is), and the
    job grows back to 2 nodes from that save, losing no step.  That save takes ``SLOW_SAVE_S`` (40 s,
    ``INSTCLS_SLOW_SAVE``): longer than the 30 s torch's agent gives its own workers on a membership
    change, so it completes only because `instcls launch`'s torchrun stops them with the
    ``--shutdown-timeout`` (``trainer.parallel.torchrun_agent``)."""
    reference = _uninterrupted(context, "uninterrupted-sync-6", SIX_STEPS)
    with TwoNodeJob(context.directory("node-returns"), context.shards, overrides=list(SIX_STEPS),
                    min_nodes=1, last_call_s=LAST_CALL_S, shutdown_timeout_s=SHUTDOWN_TIMEOUT_S) as job:
        survivor = job.start(0, _held(4), once="held-alone", INSTCLS_SLOW_SAVE=f"{SLOW_SAVE_S},step=4")
        victim = job.start(1, _held(3))
        fault = _lose_mid_step(job, victim)
        alone = survivor.wait_for("restart 1: 2 -> 1 ranks", timeout=300) and survivor.wait_for(WAITS, timeout=300)
        returned_at = time.time()
        back = job.start(1)
        codes = job.wait([survivor, back])
    changes = restarts(job.job)
    sizes = [(r["previous_world_size"], r["world_size"]) for r in changes]
    grew = changes[-1] if len(changes) == 2 else {}
    accounting, counted = accounting_difference(job.shared, reference.run_dir)
    curves, summary = compare_curves(job.job, reference, exact_until=2)
    replicated = replicated_difference(job.job, step=6)
    return DrillResult(
        "node-returns", "node 1 lost in step 3 (--nnodes 1:2), back while node 0 trains alone in step 4",
        f"world sizes {' then '.join(f'{a} -> {b}' for a, b in sizes)}; exits (node 0, node 1) {codes}; on its "
        f"return {grew.get('steps_lost')} steps lost, training stood still {grew.get('stopped_seconds')} s; "
        + (accounting or f"each of the {counted} ids of steps 1-6 consumed once, at the same step") + f"; {summary}",
        curves or accounting or replicated
        or f"none: every id consumed once; on the return {grew.get('steps_lost')} steps trained again",
        recovery_time(job.job, returned_at) if alone else None,
        fault is not None and alone and codes == [0, 0] and sizes == [(2, 1), (1, 2)] and grew.get("steps_lost") == 0
        and accounting is None and curves is None and replicated is None)


def replicated_difference(job: Job, step: int) -> str | None:
    """None when every rank's check at ``step``'s save found the state all ranks hold alike alike."""
    logs = RunLogs.read(job.run_dir / "logs")
    checks = [r for rank in logs.by_rank for r in logs.events("replicated", rank) if r.get("step") == step]
    if len(checks) != 2 or not all(c["entries"] for c in checks):
        return f"{len(checks)} ranks checked their replicated state at step {step}'s save, not 2"
    diverged = sorted({entry for c in checks for entry in c["diverged"]})
    return f"replicated state differs across the ranks: {diverged[:5]}" if diverged else None
