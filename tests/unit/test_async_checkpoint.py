"""Asynchronous saves (``engine.async_checkpoint``): the caller gets back once a snapshot is taken,
the files are those of the moment of the save whatever training does next, at most one save is in
flight (the next waits for it), a failed background write is raised by the next save, and
``checkpoint.keep_last`` prunes only after a save is complete."""

import threading
from pathlib import Path

import pytest
import torch

from trainer.checkpoint.async_checkpoint import AsyncCheckpointer
from trainer.checkpoint.checkpoint_files import checkpoint_damage, complete_checkpoints, read_trainer_meta
from trainer.checkpoint.components import FieldsState, load_checkpoint
from trainer.checkpoint.save_guard import CheckpointWriteError
from trainer.checkpoint.save_plan import FileWrite
from trainer.config import CheckpointSection, ConfigError
from trainer.parallel import single_process_dims
from trainer.parallel.sharded_state import ShardedRows

DIMS = single_process_dims(torch.device("cpu"))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Position:
    def __init__(self, step: int = 0) -> None:
        self.global_step = step


class Table:
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows, self.count = rows, 0

    def state_dict(self) -> dict:
        return {"rows": ShardedRows(self.rows, 0, len(self.rows), len(self.rows)), "count": torch.tensor(self.count)}

    def load_state_dict(self, state: dict) -> None:
        self.rows, self.count = state["rows"].rows.clone(), int(state["count"])


class Gate:
    """An entry whose file is written only once ``opened`` is set: holds the writer thread."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def snapshot(self, path: Path, dims, step: int):
        return [FileWrite("gate.pt", {"step": step}, owned=True, save=self._save)]

    def _save(self, payload, file: str) -> None:
        assert self.opened.wait(timeout=60)
        torch.save(payload, file)

    def load_from(self, path: Path, dims) -> None:
        pass


def _state(position, table, gate=None) -> dict:
    return {"trainer": FieldsState(position), **({"gate": gate} if gate else {}), "table": table}


def _saved(path: Path) -> Table:
    table = Table(torch.zeros(4, 3))
    load_checkpoint(path, _state(Position(), table), DIMS)
    return table


def test_the_files_hold_the_state_at_the_save_whatever_training_does_meanwhile(tmp_path):
    position, table, gate = Position(2), Table(torch.arange(12.0).view(4, 3)), Gate()
    checkpointer = AsyncCheckpointer(tmp_path, DIMS, keep_last=5)
    try:
        assert checkpointer.save(2, _state(position, table, gate)) is None  # back before anything is written
        assert checkpointer.step_in_flight == 2 and complete_checkpoints(tmp_path) == []
        table.rows.mul_(-1)  # training goes on, in place
        table.count, position.global_step = 9, 3
        second = threading.Thread(target=checkpointer.save, args=(3, _state(position, table, gate)))
        second.start()
        second.join(timeout=0.5)
        assert second.is_alive(), "a second save must wait for the one in flight"
        gate.opened.set()
        second.join(timeout=60)
        last = checkpointer.wait()
    finally:
        checkpointer.close()
    first, newest = complete_checkpoints(tmp_path)
    assert last == newest and newest.name == "step_000000003"
    assert torch.equal(_saved(first).rows, torch.arange(12.0).view(4, 3)) and _saved(first).count == 0
    assert torch.equal(_saved(newest).rows, -torch.arange(12.0).view(4, 3)) and _saved(newest).count == 9
    assert read_trainer_meta(first)["global_step"] == 2
    assert checkpoint_damage(first) is None and checkpoint_damage(newest) is None
    manifest = (first / "manifest.json").read_text()
    assert all(name in manifest for name in ("gate.pt", "components/table/rank-00000.pt",
                                             "components/table/rows/.metadata", "components/table/rows/__0_0.distcp"))


def test_keep_last_prunes_older_checkpoints_once_a_save_is_complete(tmp_path):
    table, gate = Table(torch.ones(4, 3)), Gate()
    names = lambda: [p.name for p in complete_checkpoints(tmp_path)]  # noqa: E731
    checkpointer = AsyncCheckpointer(tmp_path, DIMS, keep_last=2)
    try:
        for step in (1, 2):
            assert checkpointer.save(step, _state(Position(step), table), blocking=True).name == f"step_00000000{step}"
        checkpointer.save(3, _state(Position(3), table, gate))
        assert names() == ["step_000000001", "step_000000002"]  # nothing goes while step 3 is in flight
        gate.opened.set()
        checkpointer.wait()
    finally:
        checkpointer.close()
    assert names() == ["step_000000002", "step_000000003"]


class FailsToWrite(Gate):
    def _save(self, payload, file: str) -> None:
        raise OSError(28, "No space left on device", file)


def test_a_failed_background_write_is_raised_by_the_next_save_and_leaves_nothing(tmp_path):
    checkpointer = AsyncCheckpointer(tmp_path, DIMS, keep_last=2)
    table = Table(torch.ones(4, 3))
    try:
        checkpointer.save(1, _state(Position(1), table, FailsToWrite()))  # returns: the write fails later
        with pytest.raises(CheckpointWriteError, match=r"rank 0 could not write checkpoint .*step_000000001: "
                           r".*No space left on device"):
            checkpointer.save(2, _state(Position(2), table))
        assert checkpointer.save(2, _state(Position(2), table), blocking=True).name == "step_000000002"
    finally:
        checkpointer.close()
    assert [p.name for p in tmp_path.iterdir()] == ["step_000000002"]


def test_keep_last_is_validated_and_keep_still_reads():
    assert CheckpointSection().keep_last == 2
    assert CheckpointSection(keep=5).keep_last == 5
    with pytest.raises(ConfigError, match=r"checkpoint.keep_last=0 is invalid: keep at least the newest"):
        CheckpointSection(keep_last=0)
    with pytest.raises(ConfigError, match=r"checkpoint.keep=3 and checkpoint.keep_last=4 disagree"):
        CheckpointSection(keep=3, keep_last=4)
