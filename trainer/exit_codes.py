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
- ``STORE_HOST_LOST`` (144): torchrun's agent lost the c10d rendezvous store after this node's ranks
  had run, because the pod that hosts it (pod 0) is gone.  Nothing here is wrong: the pod must
  restart and rejoin the store pod 0's replacement hosts.  The Indexed Job counts it like a crash;
  the ExitCode policy, which would fail the whole job on 1, recreates the pod (128-255).

Which reports count: torchrun's last round's only.  Each rank reports in a file of this node's
report directory, and torch's elastic agent re-ranks the nodes at every rendezvous round, so a file
an earlier round left under another global rank (a 143 from the stop of a membership change) would
otherwise turn the last round's crash into a preemption that the Job never counts.  So the agent
(``trainer.parallel.torchrun_agent``) numbers the rounds it starts (``begin_round``: the number in
the directory's ``round`` file, handed to the round's workers in ``INSTCLS_EXIT_CODE_ROUND``), every
report is named by its round and rank, and the launcher reads the newest round's reports only; a
worker of that round killed before it could report (the OOM killer) leaves no report, never an
older one (as keying the reports by ``LOCAL_RANK`` would leave).  No report of an earlier round is
deleted while torchrun runs, so ``hopeless_failure``'s watch, which reads every round (a code no
restart heals is final whichever round wrote it), never misses one.  Not
``TORCHELASTIC_RESTART_COUNT``: a membership change restarts the workers without counting up.
"""

from __future__ import annotations

import os
import re
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
    STORE_HOST_LOST = 144  # the pod hosting the rendezvous store was lost mid-run: rejoin its replacement


RETRYABLE = frozenset({ExitCode.PREEMPTED})  # retried and never counted as a failure
# Retried, and counted where the job's policy counts failures (the Indexed Job's backoffLimitPerIndex):
# in 128-255, so that the Kubeflow ExitCode policy recreates the pod rather than fail the job.
RECREATED = frozenset({ExitCode.STORE_HOST_LOST})
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


LOST_STORE = "RendezvousConnectionError"  # torch's agent, when the c10d store it used is gone


def with_lost_store_host(code: int, ranks_started: bool, torchrun_stderr: str) -> int:
    """``STORE_HOST_LOST`` in place of ``CRASHED`` when torchrun's agent lost its rendezvous store after
    this node's ranks had run: the pod hosting the store (pod 0) is gone, and this pod rejoins only
    when restarted after pod 0's replacement hosts a new one.  Under Kubeflow's ExitCode policy a 1
    would fail the whole job for the loss of one node; before any rank ran, an unreachable store is
    a wrong endpoint, and stays a crash."""
    if code == ExitCode.CRASHED and ranks_started and LOST_STORE in torchrun_stderr:
        return ExitCode.STORE_HOST_LOST
    return code


# How a rank tells `instcls launch` its code: a file per rank in this directory (set by the launcher):
# the code, the time it was decided, and the one line that says why a failed rank failed.
EXIT_CODE_ENV = "INSTCLS_EXIT_CODE_DIR"
ROUND_ENV = "INSTCLS_EXIT_CODE_ROUND"  # the agent's number of the round a worker belongs to
ROUND_FILE = "round"  # the number of the newest round the agent started
_REPORT_NAME = re.compile(r"rank-(\d+)(?:-round-(\d+))?")
_failure_cause: list[str] = []


def _write_atomically(path: Path, text: str) -> None:
    """Readers (the launcher's watch reads while ranks write) see the whole file or none of it."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def begin_round(directory: Path) -> int:
    """The agent's, before it starts a round of workers: the round's number (1, 2, ...), recorded as
    the newest round in ``directory``."""
    path = Path(directory) / ROUND_FILE
    number = int(path.read_text()) + 1 if path.is_file() else 1
    _write_atomically(path, f"{number}\n")
    return number


def record_failure_cause(line: str) -> None:
    """The line this rank printed for its failure, for the launcher to repeat as the job's last line."""
    _failure_cause[:] = [" ".join(line.split())]


def _exception_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def run_reporting_exit_code(main: Callable[[], int]) -> int:
    """Run a worker's ``main`` and leave its exit code (an unhandled exception: ``CRASHED``) where
    ``instcls launch`` reads it, named by this worker's rank and round.  Its ``started`` file tells
    the launcher the rendezvous is over (torchrun starts workers only then)."""
    directory, rank = os.environ.get(EXIT_CODE_ENV), os.environ.get("RANK")
    if not directory or rank is None:
        return main()
    number = os.environ.get(ROUND_ENV)
    report = Path(directory) / (f"rank-{int(rank):05d}" + (f"-round-{int(number)}" if number else ""))
    report.unlink(missing_ok=True)  # the same name from an earlier run of this worker: not this one's code
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
        _write_atomically(report, f"{int(code)}\n{time.time():.6f}\n{cause}\n")


def newest_round(directory: Path) -> int | None:
    """The number of the last round the agent started (None: no agent numbered the rounds)."""
    path = Path(directory) / ROUND_FILE
    return int(path.read_text()) if path.is_file() else None


def _reports(directory: Path, every_round: bool) -> list[tuple[int, list[str]]]:
    """``(rank, lines)`` of the newest round's reports, or of every round's."""
    newest = None if every_round else newest_round(directory)
    reports = []
    for path in sorted(Path(directory).glob("rank-*")):
        name = _REPORT_NAME.fullmatch(path.name)
        if name is None or (newest is not None and name.group(2) != str(newest)):
            continue
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:  # a worker starting just now removed its own earlier report
            continue
        if lines and lines[0].strip().lstrip("-").isdigit():
            reports.append((int(name.group(1)), lines))
    return reports


def reported_exit_codes(directory: Path, every_round: bool = False) -> list[int]:
    """The codes the ranks of the newest round (``every_round``: of all rounds) left in ``directory``."""
    return [int(lines[0]) for _, lines in _reports(directory, every_round)]


def first_failure(directory: Path, every_round: bool = False, codes=None) -> tuple[int, str] | None:
    """``(rank, cause)`` of the rank whose failure (one of ``codes``, if given) was decided first, in
    the newest round or in any: the root cause, where the others failed after it (a peer's closed
    connection, an interrupted collective save)."""
    failed = [(float(lines[1]), rank, lines[2] if len(lines) > 2 else "") for rank, lines in
              _reports(directory, every_round) if int(lines[0]) not in (ExitCode.FINISHED, ExitCode.PREEMPTED)
              and (codes is None or int(lines[0]) in codes) and len(lines) > 1]
    if not failed:
        return None
    _, rank, cause = min(failed)
    return rank, cause or "(it printed no cause; see its output above)"


def any_rank_started(directory: Path) -> bool:
    return any(Path(directory).glob("started-*"))
