"""A checkpoint's writes, tried again through a transient storage error before the save fails.

A write that fails with an error a retry may heal (``is_transient_write_error``: EIO, ESTALE,
ETIMEDOUT, a connection error from a remote store: what an NFS server's failover or a store's
dropped connection reports) is tried again after 1, 2 then 4 s (``RETRY_DELAYS_S``: four tries
and 7 s of waiting at most).  Anything else fails at once, as before: a full disk, a quota, a
file-size limit, a read-only or forbidden path (ENOSPC, EDQUOT, EFBIG, EROFS, EACCES) would fail
the same way again.  An error that outlasts its tries goes on as any write error does: the save
fails, the previous complete checkpoint is untouched and the rank exits ``CHECKPOINT_WRITE_FAILED``
(4, ``trainer.checkpoint.save_guard``, ``trainer.exit_codes``).

What is tried again is one write, never the whole checkpoint.  A save is collective (DCP's save of
the rows, the gather of every rank's outcome before rank 0's commit): a rank that began its save
again would issue those collectives again alone and leave the ranks out of step, or make every
rank agree to start over, which also redoes the writes that succeeded.  Each retried unit is
local to one rank and idempotent: a file written again from its start (opened afresh, truncated);
DCP's write of this rank's files, and its coordinator's metadata file, inside the collective that
every rank enters once; the checksums (reads); rank 0's manifest, ``trainer.json`` and the final
rename (``rename_once``: done, when an earlier try renamed it and only the reply was lost).  All of
it happens in ``step_N.tmp/``, which is a checkpoint only once renamed, after every write succeeded.

During a stop (SIGTERM) the retries keep within the time left before SIGKILL
(``trainer.parallel.shutdown_clock``): a retry begins only if its wait plus as long as the failed
try took still ends before then; otherwise the error goes on at once, so that the rank reports it
itself rather than being killed in the middle of a wait.

``torch.save`` reports a failed write as a RuntimeError without its errno (its zip writer swallows
the OSError), which no classification could call transient: ``save_torch_file`` writes through a
file object that keeps the OSError and raises it.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch

from trainer.parallel import shutdown_clock

RETRY_DELAYS_S = (1.0, 2.0, 4.0)  # the waits before the second, third and fourth try
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT})
Result = TypeVar("Result")


def is_transient_write_error(error: BaseException) -> bool:
    """Whether a write that failed with ``error`` may succeed if tried again: an I/O error or stale
    handle of a network filesystem, a timeout, a remote store's connection error."""
    if isinstance(error, (ConnectionError, TimeoutError)):  # OSError(ETIMEDOUT) is a TimeoutError
        return True
    return isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS


def retry_transient(write: Callable[[], Result], what: str) -> Result:
    """``write()``, tried again after each of ``RETRY_DELAYS_S`` while it fails with a transient
    error and, during a stop, while the retry still ends before the SIGKILL; ``what`` names it."""
    delays = RETRY_DELAYS_S
    for tried, delay in enumerate((*delays, None), start=1):
        began = time.monotonic()
        try:
            return write()
        except OSError as error:
            if delay is None or not is_transient_write_error(error):
                raise
            left = shutdown_clock.seconds_left()
            if left is not None and delay + (time.monotonic() - began) > left:
                _say(f"{what} failed ({error}); {max(left, 0):.0f} s are left before this stopping rank is killed, "
                     "too few to try again")
                raise
            _say(f"{what} failed ({error}), which may be transient: try {tried + 1} of {len(delays) + 1} in "
                 f"{delay:g} s")
        time.sleep(delay)
    raise AssertionError("unreachable: the last try returns or raises")


def rename_once(source: Path, target: Path) -> None:
    """``source.rename(target)``, safe to try again: when ``source`` is gone and ``target`` is there,
    an earlier try renamed it and only its reply was lost (a network filesystem's failover)."""
    if not source.exists() and target.exists():
        return
    source.rename(target)


class _ErrnoKeepingFile:
    """The file ``torch.save`` writes to, remembering the OSError of a failed write."""

    def __init__(self, file) -> None:
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def save_json_file(payload, path: str | os.PathLike) -> None:
    """A small JSON checkpoint file (``run.json``, ``tracking.json``): a ``FileWrite``'s ``save``."""
    Path(path).write_text(json.dumps(payload, indent=1))


def save_torch_file(payload, path: str | os.PathLike, zipfile: bool = True) -> None:
    """``torch.save(payload, path)`` (``zipfile`` False: torch's legacy format, DeepSpeed's default),
    failing with the OSError of a failed write, errno and all, rather than torch's RuntimeError."""
    with open(path, "wb") as raw:
        file = _ErrnoKeepingFile(raw)
        try:
            torch.save(payload, file, _use_new_zipfile_serialization=zipfile)
        except RuntimeError:
            if file.error is None:
                raise
            raise file.error from None


def _say(line: str) -> None:
    print(f"instcls: rank {os.environ.get('RANK', '0')}: {line}", file=sys.stderr, flush=True)
