"""``optim.on_nonfinite: skip_step`` through the real trainer on 2 CPU ranks.  The drills' bad batch
(``train.nan_features``) makes rank 1's features NaN at step 3, or ``train.inf_gradient`` keeps its
loss finite and makes the gradient behind it infinite; every rank must drop that step, which leaves
the whole training state (backbone, its momentum, BatchNorm statistics, the objective's rows,
momentum and queues) bit-identical to step 2's, and training goes on.  ``instance`` at ZeRO-0
decides on the device (``trainer.engine.device_skip``: the log event carries ``skipped``); PIC,
SwAV and ZeRO-3 agree before the backward."""

import json
import subprocess

import pytest

from tests.helpers.training import FAST, REPO
from trainer.checkpoint.checkpoint_files import checkpoint_name
from trainer.drills.jobs import checkpoint_tensors, job_env, state_difference, train_command

pytestmark = pytest.mark.integration

SKIP = FAST + ["optim.on_nonfinite=skip_step", "logging.log_every=1"]


def _train(run_dir, shards, overrides, config="digits_cpu.yaml", failpoint="train.nan_features,rank=1,step=3"):
    return subprocess.run(train_command(run_dir, shards, 2, overrides, config=config), cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=job_env(INSTCLS_FAILPOINT=failpoint))


INF_GRADIENT = "train.inf_gradient,rank=1,step=3"


@pytest.mark.parametrize("config, overrides, failpoint", [
    # default suite: a dropped step changes nothing, on the device and without a host read, in
    # tests/unit/test_device_skip.py; these runs repeat it on 2 ranks through the trainer
    pytest.param("digits_cpu.yaml", [], INF_GRADIENT, marks=pytest.mark.slow, id="instance-inf-gradient"),
    pytest.param("digits_cpu.yaml", [], "train.nan_features,rank=1,step=3", marks=pytest.mark.slow,
                 id="instance-nan-loss"),
    pytest.param("digits_cpu.yaml", ["deepspeed_config=ds_configs/zero3.json"], "train.nan_features,rank=1,step=3",
                 marks=pytest.mark.slow, id="zero3"),
    pytest.param("pic_demo_cpu.yaml", [], "train.nan_features,rank=1,step=3", marks=pytest.mark.slow, id="pic"),
    # the queue is in use from the first step, so the dropped step's features must not enter it
    pytest.param("swav_demo_cpu.yaml", ["objective.queue_start_epoch=0"], "train.nan_features,rank=1,step=3",
                 marks=pytest.mark.slow, id="swav"),
])
def test_a_nonfinite_step_is_dropped_on_every_rank_and_changes_no_state(digits_split, tmp_path, config, overrides,
                                                                         failpoint):
    run_dir = tmp_path / "run"
    result = _train(run_dir, digits_split, SKIP + overrides + ["checkpoint.every_steps=1", "checkpoint.keep=9",
                                                               "max_steps=4"], config, failpoint)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        records = [json.loads(line) for line in (run_dir / "logs" / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
        skipped = [r for r in records if r["event"] == "nonfinite_step_skipped"]
        assert [r["step"] for r in skipped] == [3], f"rank {rank}"
        on_device = config == "digits_cpu.yaml" and not overrides
        assert ("skipped" in skipped[0]) == on_device, skipped  # the device path's record
        losses = [r["loss"] is None for r in records if r["event"] == "step"]
        assert losses == [False, False, failpoint != INF_GRADIENT, False]  # behind a finite loss
    before, dropped, after = (run_dir / "checkpoints" / checkpoint_name(step) for step in (2, 3, 4))
    assert state_difference(dropped, before, same_step=False) is None
    assert state_difference(after, dropped, same_step=False) is not None, "step 4 trained nothing"
    assert all(t.isfinite().all() for t in checkpoint_tensors(after).values() if t.is_floating_point())


@pytest.mark.slow  # default suite: the stop after too many in a row in tests/unit/test_device_skip.py
def test_nan_at_every_step_stops_after_max_skipped_in_a_row(digits_split, tmp_path):
    result = _train(tmp_path / "run", digits_split, SKIP + ["optim.max_skipped_in_a_row=2", "max_steps=6"],
                    failpoint="train.nan_features,rank=1")
    assert result.returncode != 0
    assert "2 steps in a row up to step 2 had a NaN or inf loss" in result.stderr
