"""`instcls launch` judges torchrun's last round of workers only: a report an earlier round left
must not decide the node's code."""

import os
import subprocess
import sys

import pytest

from trainer.drills.jobs import REPO
from trainer.exit_codes import ExitCode

pytestmark = pytest.mark.integration


def test_a_stop_reported_in_an_earlier_round_does_not_turn_the_last_rounds_crash_into_a_preemption():
    """Round 0: rank 1 reports 143 (stopped), rank 0 crashes; round 1 (the last, --max-restarts 1):
    rank 1 is killed before it reports and rank 0 crashes.  The node crashed: exit 1, counted by the
    Job, not 143, which its podFailurePolicy ignores, so that a crash loop would never end."""
    result = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "launch", "--standalone", "--nproc-per-node", "2", "--max-restarts",
         "1", "--monitor-interval", "0.1", "-m", "tests.helpers.rerun_rank"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == ExitCode.CRASHED, result.stderr[-3000:]
    assert "this node's ranks [1]" in result.stderr
