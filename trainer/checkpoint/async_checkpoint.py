"""Checkpoints that do not stop the job: the step waits for a snapshot, a writer thread does the rest.

``AsyncCheckpointer.save`` (collective, on the training thread) plans the save
(``trainer.checkpoint.components.plan_checkpoint``: the space check, DeepSpeed's and the components'
state), copies its tensors to host memory (``checkpoint_plan.HostStager``) and hands it to one
writer thread per rank: that much is the step's stall.  The writer writes this rank's files and
rows, computes their CRC-32s, and then the ranks agree: rank 0 gathers every rank's checksums (or
its failure), and only when all wrote does it write the manifest and ``trainer.json``, rename
``step_N.tmp`` to ``step_N`` and delete checkpoints beyond ``keep_last``; it then tells every rank
how the save ended.  At most one save is in flight: the next save, a blocking save (the
preemption's, the last one) and ``wait`` all wait for it first, and raise its failure on every rank
together.  A rank killed while writing leaves ``step_N.tmp``, never taken for a checkpoint.  Each of
the writes (and the checksums' reads) is tried again through a transient storage error, one file
at a time, never the collective save as a whole (``write_retry``).

Why the writer threads have a gloo process group of their own: their saves are collective (DCP
plans and writes its metadata over a group, and the commit needs every rank's outcome), and
collectives must be issued in the same order on every rank.  The training thread issues its own
on its groups at any time, so sharing a group with it would interleave the two orders; a group
used by nothing but the writers (one thread per rank, one save at a time) keeps each order
intact.  Per-rank "done" files on the shared filesystem would need polling and could not carry
DCP's planning; agreeing at the next step boundary would put the commit's round trip back on the
step's path and delay the commit to the next step.
"""

from __future__ import annotations

import datetime
import json
import shutil
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from trainer.checkpoint.checkpoint_files import (
    TRAINER_FILE,
    checkpoint_name,
    complete_checkpoints,
    file_checksums,
    write_manifest,
)
from trainer.checkpoint.components import DirectoryState, SaveJob, Stateful, plan_checkpoint
from trainer.checkpoint.save_guard import CheckpointInterrupted, CheckpointWriteError
from trainer.checkpoint.save_plan import HostStager, unstaged, write_plan
from trainer.checkpoint.write_retry import rename_once, retry_transient
from trainer.failpoints import fail_point, slow_save
from trainer.parallel import ParallelDims
from trainer.parallel.device_threads import device_thread_pool

# A writer waits this long for the slowest rank's files before its collective gives up.
WRITER_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class SaveResult:
    path: Path
    stall_s: float  # what the step waited for (the snapshot)
    total_s: float  # from the start of the save to its commit
    blocking: bool  # the caller waited for all of it


class AsyncCheckpointer:
    """Every rank's checkpoint writer (collective to build: it creates the writers' group).
    ``last_complete``: the newest checkpoint known complete (the one resumed from, at first)."""

    def __init__(self, directory: Path, dims: ParallelDims, keep_last: int, log=print,
                 last_complete: Path | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={keep_last} is invalid: keep at least the newest checkpoint (1)")
        self.directory, self.dims, self.keep_last, self.log = Path(directory), dims, keep_last, log
        self.group = dist.new_group(backend="gloo", timeout=WRITER_TIMEOUT) if dims.is_distributed else None
        # DCP's writer synchronises the current CUDA stream: the rank's own device's, not GPU 0's.
        self._executor = device_thread_pool(dims.device, "instcls-checkpoint-writer")
        self._stager = HostStager(dims.device)
        self._in_flight: tuple[SaveJob, Future] | None = None
        self._failure: BaseException | None = None
        self.last_complete = last_complete
        self.last_result: SaveResult | None = None

    @property
    def step_in_flight(self) -> int | None:
        return self._in_flight[0].step if self._in_flight else None

    def holds(self, step: int) -> bool:
        """Whether ``step`` is saved (the newest complete checkpoint) or being saved."""
        last = self.last_complete
        return self.step_in_flight == step or (last is not None and last.parent == self.directory
                                               and last.name == checkpoint_name(step))

    def save(self, step: int, state, blocking: bool = False) -> Path | None:
        """Collective: checkpoint ``state`` at ``step``.  Returns once the snapshot is taken (None),
        or, ``blocking``, once the checkpoint is complete (its path).  First waits for the save in
        flight and raises its failure."""
        self.wait()
        started = time.perf_counter()
        job = plan_checkpoint(self.directory, step, state, self.dims)
        # A blocking save writes the live tensors: nothing changes them while the caller waits.
        job.plan = unstaged(job.plan) if blocking else self._stager.stage(job.plan)
        stall = time.perf_counter() - started
        self._in_flight = (job, self._executor.submit(self._write, job, started, stall, blocking))
        return self.wait() if blocking else None

    def poll(self) -> None:
        """Take note of a save that finished (logged); never blocks.  A failure is raised later, by
        the next save or ``wait``, which every rank reaches at the same step."""
        if self._in_flight is not None and self._in_flight[1].done():
            self._collect()

    def wait(self) -> Path | None:
        """Wait for the save in flight; raise its failure; return the newest complete checkpoint."""
        if self._in_flight is not None:
            self._collect()
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        return self.last_complete

    def close(self) -> None:
        """Wait for the save in flight (its failure is logged, not raised: the caller is stopping,
        maybe because of another error) and free the writer and the staging buffers."""
        if self._in_flight is not None:
            self._collect()
        self._executor.shutdown(wait=True)
        self._stager.close()

    def _collect(self) -> None:
        job, future = self._in_flight
        self._in_flight = None
        try:
            result = future.result()
        except BaseException as error:  # noqa: B036 -- kept for wait(), which re-raises it
            self._failure = error
            self.log(f"checkpoint {job.final} failed: {error}")
            return
        self.last_complete, self.last_result = result.path, result
        # A SIGTERM grace period must cover the save in flight, then a blocking save.
        self.log(f"saved {result.path} in {result.total_s:.1f} s" + (" (the run waited for it)" if result.blocking else
                 f" in the background; the step waited {result.stall_s:.2f} s for its snapshot"))

    # -- the writer thread ----------------------------------------------------------------------

    def _write(self, job: SaveJob, started: float, stall: float, blocking: bool) -> SaveResult:
        rank = self.dims.rank
        checksums, failure = None, None
        try:
            with job.space.reporting_failures(job.tmp, rank, remove_partial=False):
                written = write_plan(job.tmp, job.plan, job.step, self.group)
                checksums = retry_transient(lambda: file_checksums(job.tmp, written), f"checksumming {job.tmp}")
        except BaseException as error:  # noqa: B036 -- this rank still reports, or the others wait forever
            failure = error
        job.plan = []  # the host copies are the stager's to reuse; nothing here holds them longer
        outcome = self._agree(job, checksums, failure)
        if failure is not None:
            raise failure
        if outcome is not None:
            raise CheckpointInterrupted(
                f"rank {rank} stopped saving checkpoint {job.final}: another rank failed ({outcome}). The partial "
                f"{job.tmp.name} is never taken for a checkpoint; the first failing rank's own error says what went "
                "wrong.")
        return SaveResult(job.final, stall, time.perf_counter() - started, blocking)

    def _agree(self, job: SaveJob, checksums: dict | None, failure: BaseException | None) -> str | None:
        """Collective over the writers' group: rank 0 commits if every rank wrote its files.
        Returns None when the checkpoint is complete, else what went wrong (first failing rank);
        raises rank 0's own failure to commit on rank 0."""
        report = {"checksums": checksums, "error": None if failure is None else f"rank {self.dims.rank}: {failure}",
                  "write_error": isinstance(failure, CheckpointWriteError)}
        own_failure = None
        try:
            reports = [report]
            if self.group is not None:
                reports = [None] * self.dims.world_size if self.dims.rank == 0 else None
                dist.gather_object(report, reports, dst=0, group=self.group)
            outcome = [None]
            if self.dims.rank == 0:
                try:
                    outcome[0] = self._commit(job, reports)
                except BaseException as error:  # noqa: B036 -- raised below, once the others know
                    own_failure, outcome[0] = error, f"rank 0: {error}"
            if self.group is not None:
                dist.broadcast_object_list(outcome, src=0, group=self.group)
        except (RuntimeError, dist.DistError) as error:  # a rank died mid-save
            if failure is None and own_failure is None:
                raise CheckpointInterrupted(f"rank {self.dims.rank} stopped saving checkpoint {job.final}: another "
                                            f"rank failed ({error}). The partial {job.tmp.name} is never taken for a "
                                            "checkpoint.") from None
            outcome = [str(error)]
        if own_failure is not None and failure is None:
            raise own_failure
        return outcome[0]

    def _commit(self, job: SaveJob, reports: list[dict]) -> str | None:
        """Rank 0: the manifest, trainer.json and the rename, or the partial directory removed."""
        failed = [r for r in reports if r["error"] is not None]
        if failed:
            if any(r["write_error"] for r in reports):
                shutil.rmtree(job.tmp, ignore_errors=True)  # give the space back; the run stops
            return failed[0]["error"]
        entries = {name: entry for r in reports for name, entry in r["checksums"].items()}
        with job.space.reporting_failures(job.tmp, 0):
            retry_transient(lambda: write_manifest(job.tmp, entries), f"writing {job.tmp.name}/manifest.json")
            meta = json.dumps(job.meta, indent=1)
            retry_transient(lambda: (job.tmp / TRAINER_FILE).write_text(meta), f"writing {job.tmp.name}/{TRAINER_FILE}")
            fail_point("checkpoint.before_rename", job.step)
            slow_save(job.step)  # a drill's stand-in for a large checkpoint's write
            if job.final.exists():  # the same step from an earlier run started with --resume none
                shutil.rmtree(job.final)
            retry_transient(lambda: rename_once(job.tmp, job.final), f"renaming {job.tmp.name}")
        fail_point("checkpoint.after_rename", job.step)
        # the newest keep_last complete ones stay, the one just written among them
        for old in complete_checkpoints(self.directory)[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return None


def save_checkpoint(directory: Path, step: int, state: Mapping[str, Stateful | DirectoryState], dims: ParallelDims,
                    keep: int) -> Path:
    """Collective: a complete checkpoint, written while the caller waits.  Returns its path."""
    checkpointer = AsyncCheckpointer(directory, dims, keep)
    try:
        return checkpointer.save(step, state, blocking=True)
    finally:
        checkpointer.close()
