"""Faults while a checkpoint is being saved: a write error (a full disk, a file-size limit) stops the
run with one clear message, the previous checkpoint stays complete, and the run resumes from it."""

import json
import os
import resource
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest
import torch

from tests.helpers.training import FAST, REPO, latest_checkpoint, run_train, train_command
from trainer.engine.checkpoint import CheckpointWriteError, checkpoint_damage, save_checkpoint
from trainer.parallel import single_process_dims

WRITE_LIMIT = 1 << 20  # bytes per file: the logs fit, the model and optimizer files do not


def _limit_file_size() -> None:
    # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG ("File too large"), as a
    # write to a full disk fails with ENOSPC: the same error path, without mounting a small tmpfs.
    resource.setrlimit(resource.RLIMIT_FSIZE, (WRITE_LIMIT, WRITE_LIMIT))


def test_a_failed_save_is_named_keeps_the_previous_checkpoint_and_resumes(digits_split, tmp_path):
    run_train(tmp_path, digits_split, 2, FAST + ["max_steps=2"])
    good = latest_checkpoint(tmp_path)

    command = train_command(tmp_path, digits_split, 2, FAST + ["max_steps=4"], resume="auto",
                            launcher=[sys.executable, "-m", "trainer.cli", "launch"])
    failed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=_limit_file_size)
    assert failed.returncode != 0
    assert "could not write checkpoint" in failed.stderr and "step_000000004" in failed.stderr, failed.stderr[-4000:]
    assert f"The previous checkpoint {good} is complete and untouched" in failed.stderr
    assert 'trainer/engine/checkpoint.py", line' not in failed.stderr, "the error came with a traceback"
    assert latest_checkpoint(tmp_path) == good and checkpoint_damage(good) is None
    assert not list((tmp_path / "checkpoints").glob("*.tmp")), "the failed save left its partial files behind"

    run_train(tmp_path, digits_split, 2, FAST + ["max_steps=4"], resume="auto")
    resumed = latest_checkpoint(tmp_path)
    assert json.loads((resumed / "trainer.json").read_text())["global_step"] == 4


def test_a_save_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    previous = tmp_path / "step_000000002"
    (previous / "deepspeed").mkdir(parents=True)
    (previous / "deepspeed" / "state.pt").write_bytes(b"x" * 5000)
    (previous / "trainer.json").write_text("{}")
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10_000, 9_000, 1_000))

    class NeverWrites:
        def save_checkpoint(self, *args, **kwargs):
            raise AssertionError("the engine was asked to write")

    with pytest.raises(CheckpointWriteError, match=r"needs about 5,002 bytes \(the size of step_000000002\) and a "
                       r"rank found only 1,000 free\. Nothing was written\. The previous checkpoint .* is complete"):
        save_checkpoint(tmp_path, 4, NeverWrites(), {}, {}, single_process_dims(torch.device("cpu")), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000002"]
