"""PIC through the real trainer on 2 CPU ranks: the sliding window and the lazily corrected rows
resume mid-window to exactly the state of an uninterrupted run, whichever row store holds them."""

import json
import shutil

import numpy as np
import pytest
import torch

from tests.helpers.training import FAST, classifier_rows, eval_knn, latest_checkpoint, replica_checks, run_train
from tests.integration.test_training import assert_same_training_state

pytestmark = pytest.mark.integration

PIC = "pic_demo_cpu.yaml"


def test_pic_resumes_mid_window_from_a_disk_store_to_the_uninterrupted_state(digits_split, tmp_path, capsys):
    """Saving brings every row up to date (so the checkpoint holds W itself), which rounds the rows
    as an uninterrupted run does only with the same checkpoint cadence: both save every 3 steps.
    The uninterrupted run (rows on the host) saves step 3 on its way; the interrupted run starts
    from that checkpoint alone, its rows in a disk store, and saves step 6 from there: the same
    checkpoint an interruption at step 3 leaves, without a third launch to write it."""
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"
    every_3 = FAST + ["checkpoint.every_steps=3", "max_steps=6"]
    disk = every_3 + ["objective.row_store=disk", f"objective.row_store_dir={tmp_path / 'rows'}"]
    run_train(uninterrupted, digits_split, 2, every_3 + ["objective.row_store=host"], config=PIC)
    first = uninterrupted / "checkpoints" / "step_000000003"
    sampler = torch.load(first / "components" / "sampler" / "rank-00000.pt", weights_only=True)
    assert sampler["kind"] == "sliding_window" and (sampler["window_size"], sampler["stride"]) == (128, 16)
    assert json.loads((first / "trainer.json").read_text())["step_in_epoch"] == 3  # 12 steps per epoch
    shutil.copytree(first, interrupted / "checkpoints" / first.name)
    run_train(interrupted, digits_split, 2, disk, resume="auto", config=PIC)
    resumed, reference = latest_checkpoint(interrupted), latest_checkpoint(uninterrupted)
    assert resumed.name == reference.name == "step_000000006"
    assert_same_training_state(resumed, reference)
    # the recent-id queue, the window's position, BN statistics...
    assert {c["step"] for c in replica_checks(uninterrupted, 2)[0]} == {3, 6}
    assert {c["step"] for c in replica_checks(interrupted, 2)[0]} == {6}

    # The disk store's files hold the rows (the rank's anonymous memory does not), and the recent
    # ids after 6 steps of 128 are the last 256 ids read.
    assert (tmp_path / "rows" / "rank-00001" / "rows.bin").stat().st_size == 719 * 2 * 128 * 4
    recent = torch.load(resumed / "components" / "objective" / "rank-00000.pt", weights_only=True)["recent"]
    assert recent["capacity"] == 256 and recent["ids"].numel() == 256
    rows = classifier_rows(resumed)
    assert rows["weight"].shape == (1438, 128) and torch.isfinite(rows["weight"]).all()
    assert np.unique(recent["ids"].numpy()).size < 256  # the window revisits ids within 2 steps
    # `instcls eval` scores a PIC checkpoint as any other: only the backbone is read.
    assert 10 < eval_knn(PIC, resumed, digits_split, capsys) <= 100
