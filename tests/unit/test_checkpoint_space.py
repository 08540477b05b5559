"""A checkpoint save that cannot fit is refused before anything is written, by every rank together
(the write-error path is also drilled on real jobs in tests/integration/test_drills.py)."""

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoint_state import file_size_limit
from trainer.checkpoint import save_checkpoint
from trainer.checkpoint.engine_state import EngineState
from trainer.checkpoint.save_guard import CheckpointInterrupted, CheckpointWriteError
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
        save_checkpoint(
            tmp_path, 4, {"engine": EngineState(NeverWrites())}, single_process_dims(torch.device("cpu")), keep=2
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000002"]


def test_the_previous_checkpoint_is_sized_from_its_manifest_without_walking_it(tmp_path, monkeypatch):
    """Every rank sizes the previous checkpoint at every save: from its manifest, one file, not a walk
    and a stat of each of its files (64 ranks on a shared filesystem); a checkpoint without a
    manifest (written before manifests) is still walked."""
    from trainer.checkpoint.checkpoint_files import checkpoint_bytes, write_manifest

    checkpoint = tmp_path / "step_000000002"
    (checkpoint / "components" / "objective").mkdir(parents=True)
    (checkpoint / "components" / "objective" / "rank-00000.pt").write_bytes(b"x" * 3000)
    (checkpoint / "model.pt").write_bytes(b"y" * 700)
    (checkpoint / "trainer.json").write_text("{}")
    walked = checkpoint_bytes(checkpoint)  # no manifest yet: walked
    assert walked == 3702
    write_manifest(checkpoint)
    expected = walked + (checkpoint / "manifest.json").stat().st_size

    def no_walking(self, pattern):
        raise AssertionError(f"walked {self}")

    monkeypatch.setattr(Path, "rglob", no_walking)
    assert checkpoint_bytes(checkpoint) == expected


class _ZipWriter:
    """A DeepSpeed checkpoint engine writing with torch.save's zip writer."""

    def save(self, state_dict, path):
        torch.save(state_dict, path)

    def makedirs(self, path, exist_ok=False):
        Path(path).mkdir(parents=True, exist_ok=exist_ok)


class _FakeEngine:
    """What a checkpoint touches of a DeepSpeed engine: its module, optimizer and checkpoint engine."""

    def __init__(self):
        self.module = torch.nn.Linear(2, 1)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.checkpoint_engine = _ZipWriter()


class _SavesTooMuch(_FakeEngine):
    """Has a 4 MiB tensor written, the way DeepSpeed has its files written, under a 1 MiB file-size
    limit: torch.save's zip writer fails (in the background writer) as it does on a full disk."""

    def save_checkpoint(self, save_dir, **kwargs):
        self.checkpoint_engine.makedirs(save_dir, exist_ok=True)
        self.checkpoint_engine.save(state_dict=torch.zeros(1 << 20), path=str(Path(save_dir) / "state.pt"))


@pytest.fixture
def one_mib_file_limit():
    with file_size_limit(1 << 20):
        yield


def test_a_failed_write_removes_the_partial_directory_and_names_the_checkpoint(tmp_path, one_mib_file_limit):
    with pytest.raises(
        CheckpointWriteError, match=r"rank 0 could not write checkpoint .*step_000000004: .*inline_container"
    ):
        save_checkpoint(
            tmp_path, 4, {"engine": EngineState(_SavesTooMuch())}, single_process_dims(torch.device("cpu")), keep=2
        )
    assert list(tmp_path.iterdir()) == []


class _PeerDies(_FakeEngine):
    def save_checkpoint(self, *args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:26550: Connection reset by peer")


def test_a_rank_lost_mid_save_is_not_reported_as_a_write_failure(tmp_path):
    # gloo raises a plain RuntimeError; calling it a full disk would send the user the wrong way
    with pytest.raises(
        CheckpointInterrupted,
        match=r"^rank 0 stopped saving checkpoint .*step_000000004: another "
        r"rank failed \(\[gloo.*Connection reset by peer\)\. The partial step_000000004\.tmp is never "
        r"taken for a checkpoint",
    ):
        save_checkpoint(
            tmp_path, 4, {"engine": EngineState(_PeerDies())}, single_process_dims(torch.device("cpu")), keep=2
        )
    assert [p.name for p in tmp_path.iterdir()] == ["step_000000004.tmp"]  # removed by the next save


class _HasABug(_FakeEngine):
    def save_checkpoint(self, *args, **kwargs):
        raise RuntimeError("shape mismatch")


def test_any_other_error_of_a_save_propagates_unchanged(tmp_path):
    with pytest.raises(RuntimeError, match=r"^shape mismatch$") as raised:
        save_checkpoint(
            tmp_path, 4, {"engine": EngineState(_HasABug())}, single_process_dims(torch.device("cpu")), keep=2
        )
    assert type(raised.value) is RuntimeError
