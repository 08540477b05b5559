"""Drills that take a whole node away from a two-node job (``two_nodes.TwoNodeJob``): its agent and
workers killed, its pod preempted, the node that hosts the rendezvous store lost, a node that never
comes.  A node's fault is armed in its own environment only, once per job
(``INSTCLS_FAILPOINT_ONCE``), so a replacement node started with the same environment, as a new pod
is, runs past it.  The faulty rank waits after step 2's or 3's backward
(``train.wait_for_sigterm``) so that the fault lands mid-step however fast the machine is."""

from __future__ import annotations

import time

from trainer.checkpoint.checkpoint_files import checkpoint_name, complete_checkpoints
from trainer.drills.context import NO_LOSS, DrillContext, DrillResult, recovery_time, sigterm_checkpoint
from trainer.drills.jobs import accounting_difference, state_difference
from trainer.drills.two_nodes import VOLUMES, TwoNodeJob
from trainer.exit_codes import ExitCode
from trainer.parallel.local_nodes import Node

WAITS = "fail point train.wait_for_sigterm"


def _held(step: int) -> str:
    return f"train.wait_for_sigterm,step={step}"


def _against_uninterrupted(job: TwoNodeJob, context: DrillContext) -> tuple[str | None, str | None, int]:
    """(state difference, accounting difference, ids counted) of the job's final checkpoint and logs
    against the one-agent run never interrupted."""
    saved = complete_checkpoints(job.job.checkpoints)
    difference = state_difference(saved[-1], context.reference) if saved else "no checkpoint at all"
    accounting, counted = accounting_difference(job.shared, context.reference.parent.parent)
    return difference, accounting, counted


def _resumed_from(job: TwoNodeJob, checkpoint: str) -> bool:
    return f"resumed from {VOLUMES}/checkpoints/{checkpoint}" in job.output()


def _lose_mid_step(job: TwoNodeJob, victim: Node) -> float | None:
    """Kill ``victim`` (agent and workers) once its rank is held mid-step; the time of the kill."""
    if not victim.wait_for(WAITS, timeout=300):
        return None
    fault = time.time()
    victim.lose()
    return fault


def node_lost_and_replaced(context: DrillContext) -> DrillResult:
    """Node 1's agent and workers SIGKILLed in step 3, then a replacement node 1 (a new pod: restart
    count 0, the same environment): node 0's agent restarts its ranks into the next rendezvous, the
    replacement joins, the job resumes from the step-2 checkpoint and ends as if never interrupted."""
    with TwoNodeJob(context.directory("node-lost-and-replaced"), context.shards) as job:
        survivor, victim = job.start(0), job.start(1, _held(3))
        fault = _lose_mid_step(job, victim)
        replacement = job.start(1, _held(3))
        codes = job.wait([survivor, replacement])
    difference, accounting, counted = _against_uninterrupted(job, context)
    resumed = _resumed_from(job, checkpoint_name(2))
    return DrillResult(
        "node-lost-and-replaced", "node 1's agent and worker SIGKILLed in step 3, a replacement pod started for it",
        f"exits (node 0, replacement) {codes}; "
        + ("node 0's agent restarted its rank, the replacement joined, the job resumed step 2" if resumed
           else "no resume from step 2 logged") + "; "
        + (accounting or f"each of the {counted} ids of steps 1-4 consumed once, as uninterrupted"),
        difference or accounting or NO_LOSS, recovery_time(job.job, fault) if fault else None,
        fault is not None and codes == [0, 0] and resumed and difference is None and accounting is None)


def node_preempted(context: DrillContext) -> DrillResult:
    """SIGTERM to node 1's agent only (its pod preempted) in step 2: every rank saves at the same step,
    node 1's agent exits 143, node 0's agent restarts its rank into the next rendezvous, and the job
    resumes from that checkpoint when the replacement joins."""
    with TwoNodeJob(context.directory("node-preempted"), context.shards) as job:
        survivor, victim = job.start(0), job.start(1, _held(2))
        held = victim.wait_for(WAITS, timeout=300)
        fault = time.time()
        victim.preempt()
        preempted_code = job.wait([victim], timeout=300)[0]
        saved = sigterm_checkpoint(job.job, job.output())  # every rank's files in it: both stopped at that step
        survivor_waits = survivor.process.poll() is None  # restarting its rank, not taking 143 for the end
        replacement = job.start(1, _held(2))
        codes = job.wait([survivor, replacement])
    difference, accounting, _ = _against_uninterrupted(job, context)
    resumed = saved is not None and _resumed_from(job, saved.name)
    return DrillResult(
        "node-preempted", "SIGTERM to node 1's agent in step 2 (its pod preempted), then a replacement pod",
        f"every rank saved {saved.name if saved else None}; node 1's agent exited {preempted_code} (not counted "
        f"as a failure: {preempted_code == ExitCode.PREEMPTED}); node 0's agent restarted its rank and waited: "
        f"{survivor_waits}; the job resumed from that checkpoint when the replacement joined: {resumed}; exits "
        f"(node 0, replacement) {codes}",
        difference or accounting or NO_LOSS, recovery_time(job.job, fault) if held else None,
        held and preempted_code == ExitCode.PREEMPTED and survivor_waits and resumed and codes == [0, 0]
        and difference is None and accounting is None)


def store_host_lost(context: DrillContext) -> DrillResult:
    """Node 0, which hosts the c10d rendezvous store, SIGKILLed in step 3.  The store dies with it, so
    node 1's agent cannot restart its rank and exits (1, counted: Kubernetes restarts its container);
    node 0's replacement hosts a new store on the same endpoint, node 1's restarted pod joins it,
    and the job resumes from the step-2 checkpoint."""
    with TwoNodeJob(context.directory("store-host-lost"), context.shards) as job:
        victim, survivor = job.start(0, _held(3)), job.start(1)
        fault = _lose_mid_step(job, victim)
        replacement = job.start(0, _held(3))  # the new pod 0, up while node 1 finds out
        survivor_code = job.wait([survivor], timeout=300)[0]
        ended_after = round(time.time() - fault, 1) if fault else None
        restarted = job.start(1)
        codes = job.wait([replacement, restarted])
    difference, accounting, _ = _against_uninterrupted(job, context)
    resumed = _resumed_from(job, checkpoint_name(2))
    return DrillResult(
        "store-host-lost", "node 0 (the c10d store's host) SIGKILLed in step 3; replacement pods for both nodes",
        f"node 1's agent lost the store and exited {survivor_code} {ended_after} s after the fault (counted, "
        f"restarted by Kubernetes); with node 0's replacement hosting a new store, "
        + ("the job resumed step 2" if resumed else "no resume from step 2 logged") + f"; exits {codes}",
        difference or accounting or NO_LOSS, recovery_time(job.job, fault) if fault else None,
        fault is not None and survivor_code == ExitCode.CRASHED and resumed and codes == [0, 0]
        and difference is None and accounting is None)


def node_never_arrives(context: DrillContext) -> DrillResult:
    """Only node 0 is started, with a 20 s join timeout: it must give up, and its last line must say
    what to check."""
    with TwoNodeJob(context.directory("node-never-arrives"), context.shards, join_timeout_s=20) as job:
        alone = job.start(0)
        code = job.wait([alone], timeout=300)[0]
    seconds = round(time.time() - alone.started, 1)
    last = (alone.output().strip().splitlines() or [""])[-1]
    advised = "not every node joined the rendezvous in time" in last and "--nnodes" in last
    return DrillResult(
        "node-never-arrives", "a 2-node job whose second pod never starts (join_timeout=20 s)",
        f"exit {code} after {seconds} s; the last line says what to check: {advised}", "none: no step ran", None,
        code not in (None, 0) and advised and not job.job.log_records())
