"""The fault drills: each one breaks a real 2-rank CPU job the way a cluster does, then checks
what survived against a run that was never interrupted.

Every drill returns a ``DrillResult``; ``passed`` is computed from what the job left on disk and
printed, never assumed.  Jobs train the embedded digits for 4 steps with a checkpoint every 2.
The drills live by what they break: ``crashes`` (kills, a full disk, a damaged checkpoint),
``preemption`` (SIGTERM, to the launcher or to one rank), ``nonfinite`` (NaN losses), ``ports``
(taken ports), ``tampered_files`` (a checkpoint or shard altered on disk), ``node_faults`` (a node
that never starts), ``overlay_drills`` (each multi-node overlay's own pods, ``trainer.drills.pods``:
a pod replaced, preempted or deleted, a node lost for good and back); ``context`` holds what
they share.
"""

from __future__ import annotations

from typing import Callable

from trainer.drills.context import DrillContext, DrillResult
from trainer.drills.crashes import (
    damaged_newest_checkpoint,
    disk_full_during_save,
    killed_during_save,
    rank_killed_mid_step,
    rank_killed_while_saving,
)
from trainer.drills.node_faults import node_never_arrives
from trainer.drills.nonfinite import loss_becomes_nan, nan_step_skipped
from trainer.drills.overlay_drills import overlay_drills
from trainer.drills.ports import metrics_port_taken, rendezvous_port_taken, taken_port
from trainer.drills.preemption import peer_preempted, preempted_with_sigterm
from trainer.drills.tampered_files import (
    TouchesAFile,
    checkpoint_with_pickled_code,
    shard_damaged_mid_run,
    shard_damaged_skipped,
)

# Also importable from here: the pieces the tests drive on their own.
__all__ = ["DRILLS", "NODE_DRILLS", "DrillContext", "DrillResult", "TouchesAFile", "killed_during_save", "taken_port"]

DRILLS: dict[str, Callable[[DrillContext], DrillResult]] = {
    "rank-killed-mid-step": rank_killed_mid_step,
    "rank-killed-while-saving": rank_killed_while_saving,
    "damaged-newest-checkpoint": damaged_newest_checkpoint,
    "disk-full-during-save": disk_full_during_save,
    "preempted-with-sigterm": preempted_with_sigterm,
    "peer-preempted": peer_preempted,
    "loss-becomes-nan": loss_becomes_nan,
    "nan-step-skipped": nan_step_skipped,
    "metrics-port-taken": metrics_port_taken,
    "rendezvous-port-taken": rendezvous_port_taken,
    "checkpoint-with-pickled-code": checkpoint_with_pickled_code,
    "shard-damaged-mid-run": shard_damaged_mid_run,
    "shard-damaged-skipped": shard_damaged_skipped,
    "node-never-arrives": node_never_arrives,
    **overlay_drills(),  # OVERLAY/DRILL: the overlays' own pods
}
NODE_DRILLS = ("node-never-arrives", *overlay_drills())  # several agents: tests/integration/test_pod_drills.py
