"""`instcls launch` ends at the first failure that a restart cannot heal: under `--max-restarts 100`
a bad input on one rank of 2 ends the launch with exit 2 at once, naming the rank and the cause, and
torchrun never begins a second round of workers (it would otherwise restart them 100 times)."""

import os
import subprocess
import sys
import time

import pytest

from trainer.drills.jobs import REPO, train_arguments
from trainer.exit_codes import ExitCode

pytestmark = pytest.mark.integration


def test_a_bad_input_on_one_rank_ends_the_launch_without_a_second_round(tmp_path):
    starts = tmp_path / "starts"
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "launch", "--standalone", "--nproc-per-node", "2", "--max-restarts",
         "100", "--monitor-interval", "0.1", "-m", "tests.helpers.hopeless_rank"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, HOPELESS_STARTS=str(starts), OMP_NUM_THREADS="1"))
    seconds = time.monotonic() - began
    assert result.returncode == ExitCode.BAD_INPUT, result.stderr[-3000:]
    rounds = {line.split()[1] for line in starts.read_text().splitlines()}
    assert rounds <= {"0", "1"}, starts.read_text()  # at most the round torchrun had begun already
    assert "rank 1 exited 2 (BAD_INPUT): instcls: error: data.train_shards=/nowhere has no shards" in result.stderr
    assert "torchrun is stopped now instead of restarting the workers" in result.stderr
    assert seconds < 100, seconds  # rank 0 sleeps 120 s: it was stopped, not waited for


@pytest.mark.slow  # a real elastic launch (one node of a 1:3 range); the check itself: tests/unit/test_elastic_range.py
def test_an_elastic_range_the_global_batch_cannot_serve_is_refused_at_the_first_start(digits_split, tmp_path):
    """`--nnodes 1:3` of one rank each: the global batch is 33 x 3 = 99, which 2 ranks cannot split.
    The one node that starts refuses it before step 1 (exit 2), naming the batch that would serve."""
    result = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "launch", "--standalone", "--nnodes", "1:3", "--nproc-per-node", "1",
         "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "100", "-m", *train_arguments(
             tmp_path, digits_split, ["data.loader.batch_size=33", "max_steps=2"])],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == ExitCode.BAD_INPUT, result.stderr[-3000:]
    assert "the global batch 99 does not split over 2 ranks" in result.stderr
    assert "set data.loader.batch_size=34" in result.stderr
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
