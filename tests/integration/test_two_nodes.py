"""A job on two nodes (two `instcls launch` agents, a c10d rendezvous on the loopback interface, one
rank each, every node in its own working directory) ends bit-identical to the same job under one
agent, and what a second node sees differently works: its metrics port, its rank's log, its rank's
checkpoint files, relative paths resolved against its own directory.

The node-level faults are drills on the overlays' own pods (``tests/integration/test_pod_drills.py``),
whose default cases train two pods to the uninterrupted run's state: this job and the node that never
comes run in the slow tier and in `make drill`."""

import re
import threading
import time
import urllib.request

import pytest

from trainer.checkpoint.checkpoint_files import complete_checkpoints
from trainer.drills.catalogue import DRILLS, NODE_DRILLS
from trainer.drills.jobs import accounting_difference, state_difference
from trainer.drills.two_nodes import TwoNodeJob

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("drill-context")]  # one worker builds its inputs



@pytest.fixture
def context(drill_context):
    return drill_context


def _scrape_ranks(ports: dict[int, int], running: threading.Event, found: dict[int, set[str]]) -> None:
    """Poll each node's metrics port while the job runs; the ranks its metrics are labelled with."""
    while running.is_set():
        for node, port in ports.items():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                continue  # not serving yet, or already done
            found[node] |= set(re.findall(r'instcls_samples_processed_total\{rank="(\d+)"\}', text))
        time.sleep(0.2)


@pytest.mark.slow  # the default run's pod drills train two pods to the uninterrupted state
def test_two_nodes_train_exactly_as_one_agent_with_the_same_ranks(context, tmp_path):
    scraped: dict[int, set[str]] = {0: set(), 1: set()}
    running = threading.Event()
    running.set()
    with TwoNodeJob(tmp_path / "two-nodes", context.shards) as job:
        scraper = threading.Thread(target=_scrape_ranks, args=(job.metrics_ports, running, scraped), daemon=True)
        scraper.start()
        codes = job.wait([job.start(0), job.start(1)])
        running.clear()
        scraper.join()
    assert codes == [0, 0], job.output()[-4000:]

    # the same 4 steps under one torchrun with 2 processes: bit-identical state, the same ids per step
    final = complete_checkpoints(job.job.checkpoints)[-1]
    assert state_difference(final, context.reference) is None
    assert accounting_difference(job.shared, context.reference.parent.parent) == (None, 512)

    # which global rank each node ran, from the line every rank prints at start
    node_of_rank = {int(rank): node.index for node in job.nodes
                    for rank in re.findall(r"\[instcls\] rank (\d)/2 \(local 0\)", node.output())}
    assert sorted(node_of_rank) == [0, 1] and sorted(node_of_rank.values()) == [0, 1], job.output()[-3000:]
    # each node served its own rank's metrics on its own port (local rank 0 at the node's base port)
    assert {node: {int(r) for r in ranks} for node, ranks in scraped.items()} == \
        {node: {rank for rank, on in node_of_rank.items() if on == node} for node in (0, 1)}
    # one log per global rank, and the rank on the other node wrote its own files into the checkpoint
    for rank in (0, 1):
        records = job.job.log_records(rank)
        assert any(r.get("event") == "start" and r.get("rank") == rank for r in records)
    remote_rank = next(rank for rank, node in node_of_rank.items() if node == 1)
    assert list(final.glob(f"components/*/rank-{remote_rank:05d}.pt")), sorted(final.rglob("*"))
    # relative paths: each node's working directory holds nothing of the job but its link to the volumes
    for node in (0, 1):
        own = {path.name for path in job.node_directory(node).iterdir()}
        assert own <= {"volumes", "scratch", "agent-0.txt"}, own


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in NODE_DRILLS if "/" not in name])  # the overlays': test_pod_drills
def test_node_drill(context, name):
    result = DRILLS[name](context)
    assert result.passed, str(result)
    assert result.data_lost.startswith("none"), result
