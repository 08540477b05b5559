"""Evaluation cannot fail a run after its training: unlabelled evaluation data stops the run before
step 1 with exit 2 and the field to fix, and a failure of the end-of-run evaluation, once the final
checkpoint is complete, leaves exit 0, a summary that says why, and that checkpoint whole.  (One
rank each: the guards are the same on any number.)"""

import json
import os
import subprocess

import pytest

from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.sources.generated import Source, SourceImage
from tests.helpers.training import REPO, latest_checkpoint, train_command
from trainer.checkpoint.checkpoint_files import checkpoint_damage
from trainer.drills.jobs import LAUNCH

pytestmark = pytest.mark.integration

ONE_EPOCH = ["data.loader.batch_size=32", "optim.epochs=1", "eval.knn_at_end=true", "checkpoint.every_epochs=1"]


def _run(run_dir, shards, overrides, **env):
    command = train_command(run_dir, shards, 1, ONE_EPOCH + overrides, launcher=LAUNCH)  # its exit codes: a Job's
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **env))


def _records(run_dir):
    path = run_dir / "logs" / "rank-00000.jsonl"
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


def test_unlabelled_eval_data_stops_the_run_before_its_first_step(tiny_digits_split, unlabelled_val, tmp_path):
    shards = dict(tiny_digits_split, val=unlabelled_val)
    result = _run(tmp_path, shards, [])
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert f"data.eval_shards={unlabelled_val}: 64 of its 64 samples have no label" in result.stderr, \
        result.stderr[-3000:]
    assert not [r for r in _records(tmp_path) if r["event"] == "step"], "refused before any step"
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_a_failing_end_of_run_evaluation_leaves_a_finished_run(tiny_digits_split, tmp_path):
    result = _run(tmp_path, tiny_digits_split, ["eval.linear_at_end=true"], INSTCLS_FAILPOINT="eval.end_of_run")
    assert result.returncode == 0, result.stderr[-3000:]
    records = _records(tmp_path)
    failed = [r for r in records if r["event"] == "eval_failed"]
    assert len(failed) == 1 and "fail point eval.end_of_run" in failed[0]["cause"], records[-4:]
    summary = records[-1]
    assert summary["event"] == "summary" and summary["stopped_by"] == "finished", summary
    assert "fail point eval.end_of_run" in summary["eval_failed"], summary
    assert "the end-of-run evaluation failed" in result.stdout and "re-score it with" in result.stdout
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.name == "step_000000004" and checkpoint_damage(checkpoint) is None
