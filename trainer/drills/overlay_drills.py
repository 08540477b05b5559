"""Drills on the shipped manifests: each multi-node overlay's own pods (``trainer.drills.pods``),
two nodes of one rank each, broken as a cluster breaks them.  Each drill ends in a finished job
(the controller's verdict, played from the overlay's policy), resumed from the last complete
checkpoint, and checks what the uninterrupted run trained: the same state bit for bit, or for the
elastic drills, every id consumed once at the same step.  Each pod's exit code is checked
against what the overlay's policy does with it.

- ``replaced-pod``: pod 1's processes SIGKILLed in step 3 (exit 137); a fresh pod 1 starts;
- ``store-host-replaced``: the same to pod 0, which hosts the rendezvous store;
- ``preemption``: SIGTERM with the DisruptionTarget condition to every pod in step 2: every rank
  saves at one step, each pod exits 143, and the pods are recreated;
- ``pod-deleted``: SIGTERM to pod 1 alone in step 2 (``kubectl delete pod``, 143 only);
- ``node-lost-for-good`` (elastic overlays): pod 1 SIGKILLed in step 3 and never rescheduled: the
  job goes on with one node;
- ``node-returns`` (elastic overlays): as above, and pod 1 rescheduled while node 0 saves for its
  return.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

from trainer.checkpoint.checkpoint_files import checkpoint_name, complete_checkpoints
from trainer.drills import elastic
from trainer.drills.context import FOUR_STEPS, NO_LOSS, DrillContext, DrillResult, recovery_time, sigterm_checkpoint
from trainer.drills.drill_names import ELASTIC_OVERLAYS, MULTI_NODE_OVERLAYS
from trainer.drills.jobs import accounting_difference, state_difference
from trainer.drills.pods.controllers import Action
from trainer.drills.pods.pod_job import PodJob

JOB_DEADLINE_S = 420  # a drill's job ends by then, or the drill fails (a hang is a result)
WORKER_FAILED = "] failed (exitcode:"  # torchrun's agent, on a worker that failed


def _held(step: int) -> str:
    return f"train.wait_for_sigterm,step={step}"


def _against_uninterrupted(job: PodJob, context: DrillContext) -> tuple[str | None, str | None, int]:
    saved = complete_checkpoints(job.job.checkpoints)
    difference = state_difference(saved[-1], context.reference) if saved else "no checkpoint at all"
    accounting, counted = accounting_difference(job.job.run_dir, context.reference.parent.parent)
    return difference, accounting, counted


def _resumed_from(job: PodJob, checkpoint: str) -> bool:
    return f"resumed from mnt/checkpoints/drill/checkpoints/{checkpoint}" in job.output()


def _judged(job: PodJob, pod: str, attempt: int, code: int, actions: tuple[Action, ...]) -> str | None:
    """None when the pod's attempt ended with ``code`` and its controller did one of ``actions``."""
    events = [e for e in job.events if e.pod == pod and e.attempt == attempt]
    if not events:
        return f"{pod} attempt {attempt} never ended"
    event = events[0]
    if event.code != code or event.action not in {a.value for a in actions}:
        return f"{pod} attempt {attempt} exited {event.code} ({event.action}: {event.reason}), expected {code} and " \
               f"{' or '.join(a.value for a in actions)}"
    return None


def _exits(job: PodJob) -> str:
    """Each pod attempt's exit code and what its controller did with it."""
    actions = {(e.pod, e.attempt): e.action for e in job.events}
    return ", ".join(f"{pod}#{attempt}: {code}" + (f" ({actions[pod, attempt]})" if (pod, attempt) in actions else "")
                     for pod, attempt, code in job.codes())


def _finished(job: PodJob, outcome: str) -> str | None:
    if outcome != "Succeeded":
        return f"the job did not finish: {outcome}"
    last = [lives[-1] for lives in job.attempts.values()]
    unfinished = [f"{a.pod.name} attempt {a.number}: {a.code}" for a in last if a.code != 0]
    return f"the last pods did not all exit 0: {unfinished}" if unfinished else None


def _result(name: str, overlay: str, fault: str, job: PodJob, context: DrillContext, fault_time: float | None,
            problems: list[str | None], checkpoint: str | None) -> DrillResult:
    difference, accounting, counted = _against_uninterrupted(job, context)
    resumed = checkpoint is not None and _resumed_from(job, checkpoint)
    problems = [*problems, None if resumed else f"no resume from {checkpoint} logged", difference, accounting]
    found = [p for p in problems if p]
    exits = _exits(job)
    return DrillResult(
        f"{overlay}/{name}", fault,
        f"exits {exits}; " + (f"resumed from {checkpoint}; " if resumed else "")
        + (f"each of the {counted} ids consumed once, as uninterrupted" if accounting is None else accounting)
        + (f"; problems: {'; '.join(found)}" if found else ""),
        difference or accounting or NO_LOSS, recovery_time(job.job, fault_time) if fault_time else None, not found)


def replaced_pod(context: DrillContext, overlay: str, index: int = 1) -> DrillResult:
    """Pod ``index`` SIGKILLed in step 3; its controller starts a fresh one.  Pod 0 hosts the rendezvous
    store: when it is the one lost, the other pods lose the store too and end (a counted failure, or
    a restart of their workers), and the job resumes when pod 0's replacement hosts a new one."""
    name = "replaced-pod" if index else "store-host-replaced"
    with PodJob(overlay, context.directory(f"pods-{overlay}-{name}"), context.shards, FOUR_STEPS) as job:
        job.arm(index, _held(3))
        job.start_all()
        victim = job.held(index)
        fault = time.time() if victim else None
        if victim:
            job.kill(index)
        outcome = job.run(JOB_DEADLINE_S)
    replaced = (Action.REPLACE_COUNTED, Action.REPLACE)
    return _result(name, overlay, f"pod {index} SIGKILLed in step 3, a fresh pod {index} started by its controller",
                   job, context, fault,
                   [None if victim else f"pod {index} never reached step 3", _finished(job, outcome),
                    _judged(job, job.workload.pods[index].name, 0, 137, replaced),
                    _joined_at_once(job, index) if index else None],
                   checkpoint_name(2))


def _joined_at_once(job: PodJob, index: int) -> str | None:
    """None when pod ``index``'s replacement trained without a worker of its own failing first: a
    replacement whose first workers fail (say, on a killed round's store keys) burns one of its
    ``--max-restarts`` to catch up, and a few losses in a row fail the job."""
    lives = job.attempts[index][1:]
    failed = [a.number for a in lives if WORKER_FAILED in a.output()]
    return f"{job.workload.pods[index].name}'s replacement lost a worker before it trained (attempts {failed})" \
        if failed else None


def _sigterm_drill(context: DrillContext, overlay: str, name: str, fault: str, everyone: bool) -> DrillResult:
    """SIGTERM in step 2, to every pod with the DisruptionTarget condition (``everyone``) or to pod 1
    alone: the ranks save at one step, each signalled pod exits 143 and is recreated, uncounted."""
    with PodJob(overlay, context.directory(f"pods-{overlay}-{name}"), context.shards, FOUR_STEPS) as job:
        job.arm(1, _held(2))
        job.start_all()
        held = job.held(1)
        fault_time = time.time() if held else None
        if held and everyone:
            job.preempt_all()
        elif held:
            job.delete(1)
        outcome = job.run(JOB_DEADLINE_S)
    saved = sigterm_checkpoint(job.job, job.output())
    signalled = job.workload.pods if everyone else job.workload.pods[1:2]
    judged = [_judged(job, pod.name, 0, 143, (Action.REPLACE,)) for pod in signalled]
    return _result(name, overlay, fault, job, context, fault_time,
                   [None if held else "pod 1 never reached step 2", _finished(job, outcome),
                    None if saved else "no complete checkpoint saved at the SIGTERM", *judged],
                   saved.name if saved else None)


def preemption(context: DrillContext, overlay: str) -> DrillResult:
    return _sigterm_drill(context, overlay, "preemption",
                          "SIGTERM with DisruptionTarget to every pod in step 2; pods recreated", everyone=True)


def pod_deleted(context: DrillContext, overlay: str) -> DrillResult:
    return _sigterm_drill(context, overlay, "pod-deleted",
                          "SIGTERM to pod 1 alone in step 2 (kubectl delete pod); pod recreated", everyone=False)


OVERLAY_DRILLS: dict[str, Callable[[DrillContext, str], DrillResult]] = {
    "replaced-pod": replaced_pod,
    "store-host-replaced": functools.partial(replaced_pod, index=0),
    "preemption": preemption,
    "pod-deleted": pod_deleted,
}


def node_lost_for_good(context: DrillContext, overlay: str) -> DrillResult:
    """Pod 1 SIGKILLed in step 3 and never rescheduled (its node is gone): pod 0's agent restarts its
    rank into a round of one node, which resumes the step-2 checkpoint with the same global batch."""
    reference = elastic.uninterrupted_job(context, "uninterrupted-sync-4", elastic.FOUR_STEPS)
    with PodJob(overlay, context.directory(f"pods-{overlay}-node-lost-for-good"), context.shards,
                elastic.FOUR_STEPS) as job:
        job.arm(1, _held(3))
        job.start_all()
        victim = job.held(1)
        fault = time.time() if victim else None
        if victim:
            job.lose(1)
        outcome = job.run(JOB_DEADLINE_S)
    record = (elastic.restarts(job.job) or [{}])[-1]
    shrunk = record.get("previous_world_size") == 2 and record.get("world_size") == 1
    return _elastic_result("node-lost-for-good", overlay, "pod 1 SIGKILLed in step 3, its node gone for good",
                           job, reference, fault, [None if victim else "pod 1 never reached step 3",
                                                   _finished_alone(job, outcome),
                                                   None if shrunk else f"no shrink from 2 to 1 ranks logged: {record}"])


def node_returns(context: DrillContext, overlay: str) -> DrillResult:
    """As node-lost-for-good over 6 steps; pod 1 is rescheduled while pod 0, alone, is held in step 4.
    Pod 0's agent stops its rank for the new member (SIGTERM: a save that takes 40 s), and the job
    grows back to 2 nodes from that save, losing no step."""
    reference = elastic.uninterrupted_job(context, "uninterrupted-sync-6", elastic.SIX_STEPS)
    with PodJob(overlay, context.directory(f"pods-{overlay}-node-returns"), context.shards, elastic.SIX_STEPS) as job:
        job.arm(0, _held(4), once="held-alone", INSTCLS_SLOW_SAVE=f"{elastic.SLOW_SAVE_S},step=4")
        job.arm(1, _held(3))
        job.start_all()
        victim = job.held(1)
        if victim:
            job.lose(1)
        survivor = job.current(0)
        alone = survivor.wait_for("restart 1: 2 -> 1 ranks", timeout=300) and job.held(0) is not None
        returned_at = time.time()
        job.return_node(1)
        outcome = job.run(JOB_DEADLINE_S)
    changes = elastic.restarts(job.job)
    sizes = [(r["previous_world_size"], r["world_size"]) for r in changes]
    grew = changes[-1] if len(changes) == 2 else {}
    return _elastic_result(
        "node-returns", overlay, "pod 1 lost in step 3, rescheduled while pod 0 trains alone in step 4", job, reference,
        returned_at if alone else None,
        [None if victim and alone else "the job never ran alone at step 4", _finished(job, outcome),
         None if sizes == [(2, 1), (1, 2)] and grew.get("steps_lost") == 0 else
         f"world sizes {sizes}, {grew.get('steps_lost')} steps lost on the return",
         elastic.replicated_difference(job.job, step=6)])


def _finished_alone(job: PodJob, outcome: str) -> str | None:
    if outcome != "Succeeded":
        return f"the job did not finish: {outcome}"
    return None if job.current(0).code == 0 else f"pod 0 exited {job.current(0).code}"


def _elastic_result(name: str, overlay: str, fault: str, job: PodJob, reference, fault_time: float | None,
                    problems: list[str | None]) -> DrillResult:
    accounting, counted = accounting_difference(job.job.run_dir, reference.run_dir)
    curves, summary = elastic.compare_curves(job.job, reference, exact_until=2)
    resumed = _resumed_from(job, checkpoint_name(2))
    found = [p for p in [*problems, None if resumed else "no resume from step 2 logged", accounting, curves] if p]
    exits = _exits(job)
    return DrillResult(
        f"{overlay}/{name}", fault,
        f"exits {exits}; " + (accounting or f"each of the {counted} ids consumed once, at the same step")
        + f"; {summary}" + (f"; problems: {'; '.join(found)}" if found else ""),
        curves or accounting or "none: every id consumed once",
        recovery_time(job.job, fault_time) if fault_time else None, not found)


ELASTIC_DRILLS: dict[str, Callable[[DrillContext, str], DrillResult]] = {
    "node-lost-for-good": node_lost_for_good,
    "node-returns": node_returns,
}


def overlay_drills() -> dict[str, Callable[[DrillContext], DrillResult]]:
    """Every drill of every multi-node overlay, by ``OVERLAY/DRILL``."""
    found = {}
    for overlay in MULTI_NODE_OVERLAYS:
        drills = {**OVERLAY_DRILLS, **(ELASTIC_DRILLS if overlay in ELASTIC_OVERLAYS else {})}
        for name, drill in drills.items():
            found[f"{overlay}/{name}"] = functools.partial(drill, overlay=overlay)
    return found
