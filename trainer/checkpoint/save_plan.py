"""What one save writes (a plan), its snapshot (the only part of a save a step waits for), and writing it.

Every checkpoint entry turns its state into a list of writes (``SavePlan``): files (``FileWrite``,
each with the function that writes it: ``torch.save`` keeping a failed write's errno
(``write_retry.save_torch_file``), or DeepSpeed's own checkpoint engine for its files; each file is
tried again through a transient storage error), the row-sharded tensors of a component
(``RowsWrite``, stored through DCP) and the fail points of the drills between them.  Until
``HostStager.stage`` runs, their tensors are the live ones; staging copies them to host memory so
that training may change the originals while a writer thread writes the copies.  A blocking save
skips staging and writes the live tensors (nothing changes them while the caller waits).

Staging uses DCP's ``DefaultStager``: it keeps tensors that share memory sharing it, pins the host
copies and copies without blocking on CUDA (then waits for the copies once), and keeps the host
buffers of one save to reuse in the next (the first save allocates, later ones only copy; the
buffers stay allocated, about the size of the state).  Rows marked with a ``scratch_dir`` (a disk
row store's, which may not fit in memory) are copied into a memory-mapped file there instead.
Values other than tensors are kept by reference in rebuilt containers: they must not change in
place once ``state_dict()`` returned them (ours are numbers and strings).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Union

import numpy as np
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from trainer.checkpoint.row_checkpoint import checkpointable, save_rows
from trainer.checkpoint.write_retry import retry_transient, save_torch_file
from trainer.failpoints import fail_point
from trainer.parallel.sharded_state import ShardedRows

_SCRATCH_BLOCK_ROWS = 1 << 16  # rows copied at a time into a scratch file: bounds the temporaries


@dataclass
class FileWrite:
    """One file of the checkpoint: ``path`` relative to its directory, written by ``save(payload, file)``.
    ``owned``: the payload is already a private host copy made for this save (nothing to stage)."""

    path: str
    payload: object
    owned: bool = False
    save: Callable[[object, Path], None] = save_torch_file


@dataclass
class RowsWrite:
    """The rows one component's rank writes, by their path in its state, into DCP folder ``folder``."""

    folder: str
    rows: dict[str, ShardedRows]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # DCP-ready, filled by the stager


@dataclass
class FailPoint:
    """A drill's fail point, reached by the writer when the writes before it are done."""

    name: str


SavePlan = list[Union[FileWrite, RowsWrite, FailPoint]]


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index


def _rebuild(value, leaf):
    """``value`` with each tensor or slot replaced by ``leaf(it)`` and its containers copied (dicts
    and lists keep their type, e.g. DeepSpeed's OrderedDicts; tuples too, named ones included)."""
    if isinstance(value, (torch.Tensor, _Slot)):
        return leaf(value)
    if isinstance(value, (dict, list)):
        out = copy.copy(value)
        for key in (value.keys() if isinstance(value, dict) else range(len(value))):
            out[key] = _rebuild(value[key], leaf)
        return out
    if isinstance(value, tuple):
        items = [_rebuild(item, leaf) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def copy_to_scratch(rows: torch.Tensor, directory: Path, name: str) -> torch.Tensor:
    """``rows`` copied, block by block, into a memory-mapped file in ``directory`` (reused by later
    saves).  Its blocks are allocated first: a full disk is then an OSError here, not a SIGBUS
    when a page of the mapping is written."""
    path = Path(directory) / f"checkpoint-snapshot-{name}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as file:
        os.posix_fallocate(file.fileno(), 0, rows.numel() * rows.element_size())
    numpy_dtype = torch.empty((), dtype=rows.dtype).numpy().dtype
    array = np.memmap(path, dtype=numpy_dtype, mode="r+", shape=tuple(rows.shape))
    copy = torch.from_numpy(array)
    for start in range(0, rows.shape[0], _SCRATCH_BLOCK_ROWS):
        copy[start : start + _SCRATCH_BLOCK_ROWS] = rows[start : start + _SCRATCH_BLOCK_ROWS]
    array.flush()
    return copy


class HostStager:
    """Snapshots of save plans in host memory; one per checkpointer (its buffers serve every save)."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=cuda))

    def stage(self, plan: SavePlan) -> SavePlan:
        """The plan with private host copies of its live tensors (returns when the copies are done)."""
        live: list[torch.Tensor] = []

        def take(tensor: torch.Tensor) -> _Slot:
            live.append(tensor.detach())
            return _Slot(len(live) - 1)

        skeleton: list = []
        for item in plan:
            if isinstance(item, FileWrite) and not item.owned:
                skeleton.append(_rebuild(item.payload, take))
            elif isinstance(item, RowsWrite):
                skeleton.append({key: take(rows.rows) for key, rows in item.rows.items() if rows.scratch_dir is None})
            else:
                skeleton.append(None)
        staged = self._stager.stage(live) if live else []
        out: SavePlan = []
        for item, shape in zip(plan, skeleton):
            if isinstance(item, FileWrite) and not item.owned:
                out.append(FileWrite(item.path, _rebuild(shape, lambda slot: staged[slot.index]), True, item.save))
            elif isinstance(item, RowsWrite):
                copies = {key: staged[slot.index] for key, slot in shape.items()}
                for key, rows in item.rows.items():
                    if rows.scratch_dir is not None:
                        copies[key] = copy_to_scratch(rows.rows, Path(rows.scratch_dir), key.replace(".", "-"))
                out.append(RowsWrite(item.folder, item.rows, {key: checkpointable(copies[key], rows.start, rows.total)
                                                              for key, rows in item.rows.items()}))
            else:
                out.append(item)
        return out

    def close(self) -> None:
        self._stager.close()


class HostBuffers:
    """fp32 host copies made for a save (``FileWrite(..., owned=True)``) whose memory is kept for
    the next save, as the stager keeps its own: a fresh ~100 MB copy page-faults all of its pages
    each time.  Reusing them is safe because a save's files are written before the next save
    copies anything (one save in flight).  Pinned when the source is on a GPU."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape:
            buffer = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=tensor.is_cuda)
            self._buffers[key] = buffer
        return buffer.copy_(tensor)


def unstaged(plan: SavePlan) -> SavePlan:
    """The plan writing the live tensors themselves (a blocking save: nothing changes them meanwhile)."""
    return [RowsWrite(item.folder, item.rows, {key: checkpointable(rows.rows, rows.start, rows.total)
                                               for key, rows in item.rows.items()})
            if isinstance(item, RowsWrite) else item for item in plan]


def _write_file(path: Path, item: FileWrite) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    item.save(item.payload, str(path))  # opens it afresh: a retry writes it again from its start


def write_plan(directory: Path, plan: SavePlan, step: int | None, group) -> list[str]:
    """Write ``plan`` into ``directory``; returns the files written, relative to it.  Collective over
    ``group`` (one DCP save per ``RowsWrite``, on every rank).  After a failure the remaining files
    are skipped, but every rank still takes part in each DCP save, with no rows: a rank that
    stopped would leave the others waiting in it.  The first failure is raised at the end."""
    directory = Path(directory)
    written: list[str] = []
    failure: BaseException | None = None
    for item in plan:
        try:
            if isinstance(item, RowsWrite):
                files = save_rows(directory / item.folder, item.tensors if failure is None else {}, group)
                written += [f"{item.folder}/{name}" for name in files]
            elif failure is not None:
                continue
            elif isinstance(item, FileWrite):
                retry_transient(partial(_write_file, directory / item.path, item), f"writing {item.path}")
                written.append(item.path)
            else:
                fail_point(item.name, step)
        except BaseException as error:  # noqa: B036 -- re-raised below, after the collectives
            failure = failure or error
    if failure is not None:
        raise failure
    return written
