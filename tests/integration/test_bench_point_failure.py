"""An OOM on one rank of a `bench ddp-vs-dhp` point ends the point on every rank at once.

Without the agreement the other ranks wait in a collective the failed rank never joins until the
process group's timeout (NCCL does not notice a dead peer).  The stuck collective is faked by a
long sleep (gloo, unlike NCCL, would report the dead peer's closed socket), the OOM by raising
``torch.OutOfMemoryError`` on rank 1 in the measured steps."""

from __future__ import annotations

import time

import pytest
import torch

from trainer.bench import ddp_vs_dhp
from trainer.bench.ddp_vs_dhp import SweepSettings, run_point

pytestmark = pytest.mark.integration

STUCK_S = 120  # the bench's process-group timeout


def _fake_run_steps(spec, dims):
    if spec.num_classes < 1000:  # the warm-up
        return ddp_vs_dhp.StepStatsForTest()
    if dims.rank == 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (faked)")
    time.sleep(STUCK_S)  # rank 0 inside a collective that rank 1 will never join
    raise AssertionError("rank 0 was left waiting for the collective timeout")


def _worker_with_an_oom(*args):
    ddp_vs_dhp.run_steps = _fake_run_steps
    ddp_vs_dhp.StepStatsForTest = lambda: None
    ddp_vs_dhp.apply_memory_cap = lambda device, cap: None
    ddp_vs_dhp._point_worker(*args)


def test_an_oom_on_one_rank_fails_the_point_on_all_ranks_promptly():
    start = time.perf_counter()
    point = run_point(SweepSettings(ranks=2), "dhp", 100_000, worker=_worker_with_an_oom)
    seconds = time.perf_counter() - start
    assert seconds < STUCK_S / 2, f"the point took {seconds:.0f} s: a rank waited for the failed one"
    assert point["status"] == "oom"
    statuses = {r["rank"]: r for r in point["ranks"]}
    assert statuses[1]["status"] == "oom" and "out of memory" in statuses[1]["message"]
    assert statuses[0]["status"] == "peer_failed" and "rank 1: out of memory" in statuses[0]["message"]
