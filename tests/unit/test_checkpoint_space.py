"""A checkpoint save that cannot fit is refused before anything is written, by every rank together
(the write-error path itself is drilled on real jobs in tests/integration/test_drills.py)."""

import shutil
from collections import namedtuple

import pytest
import torch

from trainer.engine.checkpoint import CheckpointWriteError, save_checkpoint
from trainer.parallel import single_process_dims


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
