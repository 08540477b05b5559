"""A two-node job (``two_nodes.TwoNodeJob``) whose second node never comes: what the launcher says
when the rendezvous times out.  The drills of nodes lost, replaced, preempted or back run on the
overlays' own pods (``trainer.drills.overlay_drills``)."""

from __future__ import annotations

import time

from trainer.drills.context import DrillContext, DrillResult
from trainer.drills.two_nodes import TwoNodeJob


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
