"""What can go wrong while a checkpoint is written, and how it is reported.

A save that cannot fit is refused before anything is written, by every rank together; a write
that fails anyway (a full disk, a file-size limit) becomes one ``CheckpointWriteError`` naming the
checkpoint and the space it needs; a rank that stops because another one died says so
(``CheckpointInterrupted``) instead of blaming the disk.  Either way the previous complete
checkpoint is untouched.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.checkpoint_files import checkpoint_bytes
from trainer.checkpoint.write_retry import is_transient_write_error
from trainer.parallel import ParallelDims


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the previous complete one is untouched."""


class CheckpointInterrupted(RuntimeError):
    """Another rank failed while this one was saving; the previous complete checkpoint is untouched."""


class PeerSaveFailed(RuntimeError):
    """A collective step of a save (DCP's, the commit's) failed because of another rank's failure."""


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@dataclass
class SpacePlan:
    """What a save expects to need: the size of the newest complete checkpoint (same model, same
    layout), and what the filesystem had free before writing."""

    directory: Path
    previous: Path | None
    expected_bytes: int
    free_bytes: int

    def _kept(self) -> str:
        return f"The previous checkpoint {self.previous} is complete and untouched" if self.previous else \
            "There is no earlier complete checkpoint"

    def _advice(self) -> str:
        return (f"{self._kept()}. Free space on {self.directory}'s filesystem, lower checkpoint.keep_last or point "
                "checkpoint.dir at a bigger volume, then resume with --resume auto.")

    @contextmanager
    def reporting_failures(self, tmp: Path, rank: int, remove_partial: bool = True):
        """Turn a failed write into one clear error; the original text is kept.  ``torch.save``
        reports a full disk as a RuntimeError from its zip writer, so that one is a write failure
        too.  A collective that fails because another rank died (gloo: "Connection reset by peer")
        is not about space: it says so and leaves the partial directory to the next save.  Any
        other RuntimeError is a bug and propagates unchanged.  ``remove_partial`` False: rank 0
        leaves the partial directory to the caller (the background writer removes it once every
        rank has stopped writing into it)."""
        try:
            yield
        except (OSError, RuntimeError) as error:
            if _another_rank_failed(error):
                raise CheckpointInterrupted(
                    f"rank {rank} stopped saving checkpoint {tmp.with_suffix('')}: another rank failed ({error}). "
                    f"The partial {tmp.name} is never taken for a checkpoint and the next save removes it; "
                    "the first failing rank's own error says what went wrong."
                ) from None
            if not isinstance(error, OSError) and not _from_torch_save_writer(error):
                raise
            if rank == 0 and remove_partial:
                shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the run stops here
            if is_transient_write_error(error):  # not about space: write_retry tried it again already
                raise CheckpointWriteError(
                    f"rank {rank} could not write checkpoint {tmp.with_suffix('')}: {error}, which is often transient "
                    "(a network filesystem's failover) but went on when the write was tried again (see the lines "
                    f"above). {self._kept()}. Check the storage of {self.directory}, then resume with --resume auto."
                ) from None
            needed = f"about {self.expected_bytes:,} bytes" if self.expected_bytes else "an unknown number of bytes"
            raise CheckpointWriteError(
                f"rank {rank} could not write checkpoint {tmp.with_suffix('')}: {error}. A checkpoint needs {needed}; "
                f"{self.free_bytes:,} bytes were free before the save. " + self._advice()
            ) from None


def _from_torch_save_writer(error: RuntimeError) -> bool:
    return any(mark in str(error) for mark in ("inline_container", "PytorchStreamWriter"))


def _another_rank_failed(error: Exception) -> bool:
    # NCCL raises DistError subclasses; gloo raises a plain RuntimeError naming the lost peer.
    return isinstance(error, (dist.DistError, PeerSaveFailed)) or (
        isinstance(error, RuntimeError) and "by peer" in str(error))


def check_space(directory: Path, final: Path, previous: Path | None, dims: ParallelDims) -> SpacePlan:
    """Refuse, on every rank together and before writing anything, a save of ``final`` that cannot
    fit, expecting it to be as big as ``previous`` (the newest complete checkpoint, if any)."""
    plan = SpacePlan(directory, previous, checkpoint_bytes(previous) if previous else 0,
                     shutil.disk_usage(_existing_parent(Path(directory))).free)
    shortfall = torch.tensor([max(0, plan.expected_bytes - plan.free_bytes)], dtype=torch.int64)
    if dims.is_distributed:
        dist.all_reduce(shortfall, op=dist.ReduceOp.MAX, group=dims.control_group)
    if shortfall.item():
        raise CheckpointWriteError(
            f"not enough space for checkpoint {final}: it needs about {plan.expected_bytes:,} bytes (the size of "
            f"{plan.previous.name}) and a rank found only {plan.expected_bytes - int(shortfall.item()):,} free. "
            "Nothing was written. " + plan._advice()
        )
    return plan
