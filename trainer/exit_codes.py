"""The exit codes of `instcls train` (every rank) and `instcls launch` (the container's main
process): the one place they are defined.  The Kubernetes manifests name them in their restart
rules; ``tests/unit/test_k8s.py`` reads the YAML and ``tests/unit/test_exit_codes.py`` the READMEs'
tables to check that they still agree with this module.

What a retry can fix decides the code, because that is all a Job controller acts on:

- ``PREEMPTED`` (143 = 128 + SIGTERM, what a shell reports for a process SIGTERM ended): the job
  was asked to stop.  Retry without counting it as a failure: the ranks saved a checkpoint at the
  step they agreed on, and if that save did not complete (the grace period ran out) the newest
  *complete* checkpoint is still there, so ``--resume auto`` loses at most the steps since it.
  The Kubeflow ``ExitCode`` restart policy retries 128-255, so it must be above 127.
- ``BAD_INPUT``, ``NONFINITE_LOSS``, ``CHECKPOINT_WRITE_FAILED``: the same attempt would fail the
  same way, so fail the job at once and let a person act (the message says what to change).  A
  full disk is one of them: a retry re-trains from the last checkpoint and fails at the same save,
  burning the steps in between on every node each time.  ExitCode's permanent range is 1-127.
- ``CRASHED`` (1, what Python and torchrun exit with on any unhandled error): an exception with no
  code of its own, a rank killed (the OOM killer's SIGKILL), a lost peer, after torchrun's
  ``--max-restarts`` are spent.  It may be a bad node or a transient NCCL error, or a bug or an
  OOM that recurs: the Indexed Job retries it a few times, counted (``backoffLimitPerIndex``);
  Kubeflow's ExitCode policy has no counted retry (the operator recreates pods for 128-255 without
  a limit), so there it is permanent rather than a loop that never ends.
"""

from __future__ import annotations

import os
import time
from enum import IntEnum
from pathlib import Path
from typing import Callable


class ExitCode(IntEnum):
    FINISHED = 0  # the configured epochs (or max_steps) are done and saved
    CRASHED = 1
    BAD_INPUT = 2  # a config, flag, shard or checkpoint the user must fix (argparse also exits 2)
    NONFINITE_LOSS = 3  # the loss or the weights became NaN/inf; nothing poisoned was saved
    CHECKPOINT_WRITE_FAILED = 4  # disk full, quota, file-size limit; the previous checkpoint is intact
    PREEMPTED = 143  # 128 + SIGTERM (15), as a shell reports it: stopped, checkpointed; run the same command again


RETRYABLE = frozenset({ExitCode.PREEMPTED})  # retried and never counted as a failure
PERMANENT = frozenset({ExitCode.BAD_INPUT, ExitCode.NONFINITE_LOSS, ExitCode.CHECKPOINT_WRITE_FAILED})  # fail the job


def node_exit_code(torchrun_code: int, rank_codes: list[int], got_sigterm: bool) -> int:
    """What `instcls launch` exits with, from torchrun's code, the codes this node's ranks reported
    (of torchrun's last round of workers; a rank killed outright reports none) and whether the
    launcher itself was sent SIGTERM.  torchrun exits 1 whenever a worker failed, whatever its
    code, so the ranks' own codes are what tells a preemption from a bad config."""
    if torchrun_code == 0:
        return ExitCode.FINISHED
    permanent = sorted(code for code in rank_codes if code in PERMANENT)
    if permanent:
        # The run cannot go on as it is, even if a SIGTERM came too (a retry would fail the same
        # way).  The lowest code is the most basic cause: a bad config before a NaN before a disk.
        return permanent[0]
    if rank_codes and all(code == ExitCode.FINISHED for code in rank_codes):
        return ExitCode.FINISHED  # every rank finished; torchrun failed only on its way out
    if got_sigterm or ExitCode.PREEMPTED in rank_codes:
        # Our pod was told to stop, or the ranks stopped because another node's pod was: in both
        # cases the run resumes from the newest complete checkpoint, saved or not just now.
        return ExitCode.PREEMPTED
    if torchrun_code < 0:  # torchrun itself was killed by a signal: report it as a shell would
        return 128 - torchrun_code
    return torchrun_code


# How a rank tells `instcls launch` its code: a file per rank in this directory (set by the launcher):
# the code, the time it was decided, and the one line that says why a failed rank failed.
EXIT_CODE_ENV = "INSTCLS_EXIT_CODE_DIR"
_failure_cause: list[str] = []


def record_failure_cause(line: str) -> None:
    """The line this rank printed for its failure, for the launcher to repeat as the job's last line."""
    _failure_cause[:] = [" ".join(line.split())]


def _exception_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def run_reporting_exit_code(main: Callable[[], int]) -> int:
    """Run a worker's ``main`` and leave its exit code (an unhandled exception: ``CRASHED``) where
    ``instcls launch`` reads it.  The rank's file from an earlier round (torchrun restarted the
    workers) is removed first: the launcher must judge the last round only.  Its ``started`` file
    tells the launcher the rendezvous is over (torchrun starts workers only then)."""
    directory, rank = os.environ.get(EXIT_CODE_ENV), os.environ.get("RANK")
    if not directory or rank is None:
        return main()
    report = Path(directory) / f"rank-{int(rank):05d}"
    report.unlink(missing_ok=True)
    (Path(directory) / f"started-{int(rank):05d}").touch()
    code: int = ExitCode.CRASHED
    try:
        code = main()
        return code
    except SystemExit as stop:  # argparse's usage errors (2), sys.exit(...) anywhere below
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        raise
    except BaseException as error:
        if not _failure_cause:
            record_failure_cause(_exception_line(error))
        raise
    finally:
        cause = _failure_cause[0] if _failure_cause and code not in (ExitCode.FINISHED, ExitCode.PREEMPTED) else ""
        report.write_text(f"{int(code)}\n{time.time():.6f}\n{cause}\n")


def _reports(directory: Path) -> list[tuple[int, list[str]]]:
    reports = []
    for path in sorted(Path(directory).glob("rank-*")):
        lines = path.read_text().splitlines()
        if lines and lines[0].strip().lstrip("-").isdigit():
            reports.append((int(path.name.split("-")[1]), lines))
    return reports


def reported_exit_codes(directory: Path) -> list[int]:
    """The codes the ranks left in ``directory`` (read once every worker has exited)."""
    return [int(lines[0]) for _, lines in _reports(directory)]


def first_failure(directory: Path) -> tuple[int, str] | None:
    """``(rank, cause)`` of the rank whose failure was decided first: the root cause, where the
    others failed after it (a peer's closed connection, an interrupted collective save)."""
    failed = [(float(lines[1]), rank, lines[2] if len(lines) > 2 else "") for rank, lines in _reports(directory)
              if int(lines[0]) not in (ExitCode.FINISHED, ExitCode.PREEMPTED) and len(lines) > 1]
    if not failed:
        return None
    _, rank, cause = min(failed)
    return rank, cause or "(it printed no cause; see its output above)"


def any_rank_started(directory: Path) -> bool:
    return any(Path(directory).glob("started-*"))
