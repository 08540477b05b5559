"""Evaluation cannot fail a run after its training: unlabelled evaluation data stops the run before
step 1 with exit 2 and the field to fix (one rank: the check is the same on any number), and a
failure of the end-of-run evaluation on one rank of two, once the final checkpoint is complete,
ends every rank with exit 0, a summary that says why, and that checkpoint whole, not evaluated
again on a resume."""

import json
import os
import signal
import subprocess

import pytest

from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.sources.generated import Source, SourceImage
from tests.helpers.training import REPO, latest_checkpoint, train_command
from trainer.checkpoint.checkpoint_files import checkpoint_damage, read_trainer_meta
from trainer.drills.jobs import LAUNCH

pytestmark = pytest.mark.integration

ONE_EPOCH = ["data.loader.batch_size=32", "optim.epochs=1", "eval.knn_at_end=true", "checkpoint.every_epochs=1"]
JOB_LIMIT_S = 120  # a job of these takes ~25 s; a rank left waiting for another waits with no end


def _run(run_dir, shards, overrides, **env):
    command = train_command(run_dir, shards, 1, ONE_EPOCH + overrides, launcher=LAUNCH)  # its exit codes: a Job's
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **env))


def _records(run_dir, rank=0):
    path = run_dir / "logs" / f"rank-{rank:05d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def unlabelled_val(tiny_digits_split, tmp_path_factory):
    """The tiny held-out digits with their labels dropped."""
    from data_pipeline.contract import sample_table

    table = sample_table(tiny_digits_split["val"])
    images = [SourceImage(f"val-{i}", -1, lambda i=i: table.read_jpeg(i)) for i in range(table.num_samples)]
    out = tmp_path_factory.mktemp("unlabelled")
    write_shards(Source("unlabelled", images, None), out, ShardSettings(prefix="val", samples_per_shard=64),
                 progress=False)
    return out


@pytest.mark.slow  # default suite: unlabelled eval data named with its field in tests/unit/test_eval_data_check.py
def test_unlabelled_eval_data_stops_the_run_before_its_first_step(tiny_digits_split, unlabelled_val, tmp_path):
    shards = dict(tiny_digits_split, val=unlabelled_val)
    result = _run(tmp_path, shards, [])
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert f"data.eval_shards={unlabelled_val}: 64 of its 64 samples have no label" in result.stderr, \
        result.stderr[-3000:]
    assert not [r for r in _records(tmp_path) if r["event"] == "step"], "refused before any step"
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def _run_two_ranks(run_dir, shards, resume, **env):
    """The 2-rank job under torchrun, whose store outlives any rank: a rank left waiting for rank
    0's work (``run_on_rank0``) waits on it with no deadline.  A job that has not ended after
    ``JOB_LIMIT_S`` is killed with its ranks, and the test fails."""
    command = train_command(run_dir, shards, 2, ONE_EPOCH + ["eval.linear_at_end=true"], resume)
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1", **env))
    try:
        stdout, stderr = job.communicate(timeout=JOB_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        pytest.fail(f"the job had not ended after {JOB_LIMIT_S} s: a rank is still waiting\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


@pytest.mark.timeout(4 * JOB_LIMIT_S)
def test_one_ranks_failing_end_of_run_evaluation_ends_every_rank_and_a_resume_does_not_repeat_it(
        tiny_digits_split, tmp_path):
    """Rank 0's end-of-run evaluation fails after the features are gathered into it for the linear
    probe, when rank 1 goes on to wait for its fit: both ranks stop at the next phase boundary,
    log the failure (rank 1 naming rank 0's cause) and exit 0 within seconds of each other, and
    the final checkpoint, whole, records that the run finished and that its evaluation failed.
    Resuming it trains and evaluates nothing (the armed fail point would fail it again)."""
    armed = {"INSTCLS_FAILPOINT": "eval.end_of_run,rank=0"}
    result = _run_two_ranks(tmp_path, tiny_digits_split, "none", **armed)
    assert result.returncode == 0, result.stderr[-3000:]
    failed = [[r for r in _records(tmp_path, rank) if r["event"] == "eval_failed"] for rank in (0, 1)]
    assert [len(records) for records in failed] == [1, 1], failed
    (own,), (other,) = failed
    assert own["cause"].startswith("RuntimeError: fail point eval.end_of_run"), own
    assert "rank 0's evaluation failed in its gather phase (RuntimeError: fail point eval.end_of_run" \
        in other["cause"], other
    assert abs(own["time"] - other["time"]) < 10, (own, other)  # not one rank waiting out a timeout
    for rank in (0, 1):
        summary = _records(tmp_path, rank)[-1]
        assert summary["event"] == "summary" and summary["stopped_by"] == "finished" and summary["eval_failed"]
    assert "the end-of-run evaluation failed" in result.stdout and "re-score it with" in result.stdout
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.name == "step_000000002" and checkpoint_damage(checkpoint) is None
    run_end = read_trainer_meta(checkpoint)["run_end"]
    assert run_end["finished"] and run_end["evaluation"] == "failed", run_end
    assert run_end["cause"].startswith("RuntimeError: fail point eval.end_of_run"), run_end

    logged = [len(_records(tmp_path, rank)) for rank in (0, 1)]
    resumed = _run_two_ranks(tmp_path, tiny_digits_split, "auto", **armed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{checkpoint} is the final checkpoint of a finished run (epoch 1, step 2): nothing to train; its " \
        "end-of-run evaluation failed" in resumed.stdout, resumed.stdout[-3000:]
    assert "instcls eval knn|linear --checkpoint auto" in resumed.stdout
    for rank in (0, 1):
        events = {r["event"] for r in _records(tmp_path, rank)[logged[rank]:]}
        assert not events & {"step", "eval", "eval_failed", "summary"}, events
    assert latest_checkpoint(tmp_path) == checkpoint and checkpoint_damage(checkpoint) is None
