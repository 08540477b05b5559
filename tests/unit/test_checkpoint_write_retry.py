"""A checkpoint write that fails with a transient storage error (a network filesystem's failover: EIO,
ESTALE, ETIMEDOUT, a remote store's dropped connection) is tried again before the save fails with
exit 4; a full disk and the other permanent errors still fail it at once.  Each retry rewrites one
file from its start, so the checkpoint that results is complete and loads."""

from __future__ import annotations

import errno
import json
import signal
import time
from dataclasses import dataclass

import pytest
import torch
from torch.distributed.checkpoint import filesystem

from tests.helpers.checkpoint_state import RowTable, file_size_limit
from trainer.checkpoint import FieldsState, load_checkpoint, save_checkpoint
from trainer.checkpoint import write_retry as write_retry_module
from trainer.checkpoint.checkpoint_files import checkpoint_damage, complete_checkpoints
from trainer.checkpoint.save_guard import CheckpointWriteError
from trainer.checkpoint.save_plan import FileWrite
from trainer.checkpoint.write_retry import is_transient_write_error, rename_once, retry_transient, save_torch_file
from trainer.engine.stop_conditions import StopSignal
from trainer.parallel import shutdown_clock, single_process_dims

DIMS = single_process_dims(torch.device("cpu"))


@pytest.mark.parametrize("error, transient", [
    (OSError(errno.EIO, "Input/output error"), True),
    (OSError(errno.ESTALE, "Stale file handle"), True),
    (OSError(errno.ETIMEDOUT, "Connection timed out"), True),
    (TimeoutError("the store did not answer"), True),  # a client's own timeout, no errno
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), True),
    (ConnectionRefusedError("the store is restarting"), True),
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), True),
    (OSError(errno.ENOSPC, "No space left on device"), False),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), False),
    (OSError(errno.EFBIG, "File too large"), False),
    (OSError(errno.EROFS, "Read-only file system"), False),
    (PermissionError(errno.EACCES, "Permission denied"), False),
    (FileNotFoundError(errno.ENOENT, "No such file or directory"), False),
    (OSError("no errno"), False),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 46 vs 0"), False),  # errno unknown
])
def test_which_write_errors_are_worth_another_try(error, transient):
    assert is_transient_write_error(error) is transient


class _Entry:
    """A checkpoint entry with one file of its own, written by ``save``."""

    def __init__(self, save) -> None:
        self.save = save

    def snapshot(self, path, dims, step):
        return [FileWrite("payload.pt", {"weights": torch.arange(1000.0)}, owned=True, save=self.save)]

    def load_from(self, path, dims):
        self.loaded = torch.load(path / "payload.pt")


def _failing(times: int, code: int, calls: list, then=None):
    """A write that leaves half a file and fails with ``code`` the first ``times`` calls, then ``then``."""
    def write(*args):
        calls.append(args)
        if len(calls) <= times:
            if args and isinstance(args[-1], str):
                with open(args[-1], "wb") as file:
                    file.write(b"half a file")
            raise OSError(code, f"{errno.errorcode[code]} on the checkpoint volume")
        return then(*args)
    return write


@pytest.fixture
def no_waits(monkeypatch):
    monkeypatch.setattr(write_retry_module, "RETRY_DELAYS_S", (0.01, 0.01, 0.01))
    monkeypatch.setattr(shutdown_clock, "_stop_began", [])  # no SIGTERM, whatever a test before had


@dataclass
class _Position:
    epoch: int = 1
    global_step: int = 6


def _state(entry):
    return {"trainer": FieldsState(_Position()), "entry": entry, "table": RowTable(torch.arange(8.0).view(4, 2))}


def test_a_file_and_the_rows_failing_with_eio_twice_then_succeeding_give_a_complete_checkpoint(
        tmp_path, monkeypatch, capsys, no_waits):
    file_calls, rows_calls = [], []
    entry = _Entry(_failing(2, errno.EIO, file_calls, then=lambda payload, path: torch.save(payload, path)))
    monkeypatch.setattr(filesystem._FileSystemWriter, "write_data",
                        _failing(2, errno.EIO, rows_calls, then=filesystem._FileSystemWriter.write_data))
    path = save_checkpoint(tmp_path, 6, _state(entry), DIMS, keep=1)
    assert len(file_calls) == 3 and len(rows_calls) == 3
    assert complete_checkpoints(tmp_path) == [path] and checkpoint_damage(path) is None
    assert not list(tmp_path.glob("*.tmp"))
    restored_entry, restored = _Entry(None), _state(None)
    restored["entry"], restored["table"] = restored_entry, RowTable(torch.zeros(4, 2))
    load_checkpoint(path, restored, DIMS)
    assert torch.equal(restored_entry.loaded["weights"], torch.arange(1000.0))
    assert torch.equal(restored["table"].rows, torch.arange(8.0).view(4, 2))
    assert json.loads((path / "trainer.json").read_text())["global_step"] == 6
    assert "EIO on the checkpoint volume), which may be transient: try 3 of 4" in capsys.readouterr().err


def test_a_full_disk_fails_the_save_at_once_as_a_write_error(tmp_path, no_waits):
    calls = []
    entry = _Entry(_failing(1, errno.ENOSPC, calls, then=lambda payload, path: torch.save(payload, path)))
    with pytest.raises(CheckpointWriteError, match=r"rank 0 could not write checkpoint .*step_000000006: .*"
                                                   r"ENOSPC on the checkpoint volume"):
        save_checkpoint(tmp_path, 6, _state(entry), DIMS, keep=1)
    assert len(calls) == 1  # CheckpointWriteError: `instcls train` exits 4 (CHECKPOINT_WRITE_FAILED)
    assert list(tmp_path.iterdir()) == []


def test_a_transient_error_that_outlasts_the_tries_fails_the_save(tmp_path, no_waits):
    calls = []
    entry = _Entry(_failing(10, errno.ESTALE, calls))
    with pytest.raises(CheckpointWriteError, match="ESTALE on the checkpoint volume, which is often transient .* "
                                                   "Check the storage of"):
        save_checkpoint(tmp_path, 6, _state(entry), DIMS, keep=1)
    assert len(calls) == 4 and list(tmp_path.iterdir()) == []


def test_a_stopping_rank_retries_only_within_the_time_left_before_its_sigkill(monkeypatch, capsys):
    monkeypatch.setenv(shutdown_clock.SHUTDOWN_TIMEOUT_ENV, "2.5")
    stop_began, waits = [time.monotonic()], []  # SIGTERM'd just now: 2.5 s to go

    def sleep(seconds):  # time passes without the test waiting for it
        waits.append(seconds)
        stop_began[0] -= seconds

    monkeypatch.setattr(write_retry_module.time, "sleep", sleep)
    monkeypatch.setattr(shutdown_clock, "_stop_began", stop_began)
    calls = []
    with pytest.raises(OSError, match="EIO on the checkpoint volume") as raised:
        retry_transient(_failing(10, errno.EIO, calls), "writing model.pt")
    assert raised.value.errno == errno.EIO
    assert waits == [1.0] and len(calls) == 2  # a 2 s wait would end after the SIGKILL
    assert "s are left before this stopping rank is killed, too few to try again" in capsys.readouterr().err


def test_the_shutdown_clock_counts_from_the_sigterm_with_the_agents_timeout(monkeypatch):
    monkeypatch.setattr(shutdown_clock, "_stop_began", [])
    monkeypatch.setenv(shutdown_clock.SHUTDOWN_TIMEOUT_ENV, "570")
    assert shutdown_clock.seconds_left() is None
    shutdown_clock.begin_shutdown(now=100.0)
    shutdown_clock.begin_shutdown(now=200.0)  # a second SIGTERM does not move the SIGKILL
    assert shutdown_clock.seconds_left(now=160.0) == 510.0
    monkeypatch.setattr(shutdown_clock, "_stop_began", [])
    stop = StopSignal(None)  # the rank's SIGTERM handler starts the clock
    try:
        stop._handle(signal.SIGTERM, None)
    finally:
        stop.restore()
    assert 569 < shutdown_clock.seconds_left() <= 570
    monkeypatch.setenv(shutdown_clock.SHUTDOWN_TIMEOUT_ENV, "10m")
    with pytest.raises(ValueError, match="INSTCLS_SHUTDOWN_TIMEOUT_S='10m' is invalid"):
        shutdown_clock.shutdown_timeout_s()


@pytest.fixture
def one_mib_file_limit():
    with file_size_limit(1 << 20):
        yield


@pytest.mark.parametrize("zipfile", [True, False])  # torch's format, and DeepSpeed's default (legacy)
def test_torch_save_fails_with_the_errno_of_the_failed_write(tmp_path, one_mib_file_limit, zipfile):
    # torch.save itself reports it as a RuntimeError without the errno ("unexpected pos", "write(): fd 3 failed")
    with pytest.raises(OSError, match="File too large") as raised:
        save_torch_file({"weights": torch.zeros(1 << 20)}, tmp_path / "model.pt", zipfile=zipfile)
    assert raised.value.errno == errno.EFBIG


def test_a_rename_whose_reply_was_lost_counts_as_done(tmp_path):
    source, target = tmp_path / "step_000000006.tmp", tmp_path / "step_000000006"
    source.mkdir()
    rename_once(source, target)
    rename_once(source, target)  # tried again after a reply lost in a failover
    assert target.is_dir() and not source.exists()
    with pytest.raises(FileNotFoundError):
        rename_once(source, tmp_path / "never_written")
