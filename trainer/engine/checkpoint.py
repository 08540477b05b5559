"""Saving and loading a checkpoint: one mapping of named entries, written atomically.

Every rank writes into ``step_N.tmp/``; rank 0 writes the manifest and ``trainer.json`` once all
ranks are done and renames the directory (the layout: ``trainer.engine.checkpoint_files``).
Entries are saved and loaded in the mapping's order (so the RNG, restored last, is not drawn
from afterwards), and this module knows none of them by name but ``trainer``: the trainer's
position, written last as ``trainer.json`` and loaded first, since others may read it.  A ``DirectoryState`` entry
writes its own files (the engine: ``trainer.engine.engine_state``; the RNG:
``trainer.engine.rng_state``).  Any other entry is a ``Stateful`` whose state each rank writes to
``components/NAME/``; tensors in it wrapped in ``ShardedRows`` are re-split by row on load
(``trainer.parallel.sharded_state``), so a checkpoint written by T ranks loads on any T'.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from trainer.engine.checkpoint_files import (
    TRAINER_FILE, checkpoint_name, complete_checkpoints, rank_file, read_trainer_meta, write_manifest,
)
from trainer.engine.failpoints import fail_point
from trainer.engine.safe_load import load_data
from trainer.engine.save_guard import check_space
from trainer.parallel import ParallelDims
from trainer.parallel.sharded_state import decode_state, encode_state

META_ENTRY = "trainer"  # the entry written as trainer.json


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class DirectoryState(Protocol):
    """An entry that writes its own files into the checkpoint directory (every rank calls both)."""

    def save_to(self, path: Path, dims: ParallelDims, step: int) -> None: ...

    def load_from(self, path: Path, dims: ParallelDims) -> None: ...


class FieldsState:
    """A dataclass's fields as a checkpoint entry (the trainer's position), loaded into the same
    object, so whatever holds it sees the restored values; ``facts`` about the run are saved
    next to them for the record and not loaded back."""

    def __init__(self, fields, **facts) -> None:
        self.fields, self.facts = fields, facts

    def state_dict(self) -> dict:
        return dict(vars(self.fields), **self.facts)

    def load_state_dict(self, state: dict) -> None:
        missing = [name for name in vars(self.fields) if name not in state]
        if missing:
            raise ValueError(f"the checkpoint's {TRAINER_FILE} lacks {missing}; was it written by another version?")
        for name in vars(self.fields):
            setattr(self.fields, name, state[name])


def _barrier(dims: ParallelDims) -> None:
    if dims.is_distributed:
        dist.barrier(group=dims.control_group)


def save_checkpoint(directory: Path, step: int, state: Mapping[str, Stateful | DirectoryState], dims: ParallelDims,
                    keep: int) -> Path:
    """Collective: every rank calls it.  Returns the final path."""
    directory = Path(directory)
    final = directory / checkpoint_name(step)
    tmp = final.with_name(final.name + ".tmp")
    if dims.rank == 0:
        for partial in directory.glob("step_*.tmp"):  # left by a run that died while saving
            shutil.rmtree(partial, ignore_errors=True)
    previous = complete_checkpoints(directory)
    space = check_space(directory, final, previous[-1] if previous else None, dims)
    with space.reporting_failures(tmp, dims.rank):
        _write(tmp, state, dims, step)
    _barrier(dims)

    if dims.rank == 0:
        with space.reporting_failures(tmp, dims.rank):
            write_manifest(tmp)
            meta = state[META_ENTRY].state_dict() if META_ENTRY in state else {}
            meta = dict(meta, world_size=dims.world_size, classifier_parallel_size=dims.classifier_parallel_size)
            (tmp / TRAINER_FILE).write_text(json.dumps(meta, indent=1))
            fail_point("checkpoint.before_rename", step)
            if final.exists():  # the same step from an earlier run started with --resume none
                shutil.rmtree(final)
            os.replace(tmp, final)
        fail_point("checkpoint.after_rename", step)
        for old in complete_checkpoints(directory)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(dims)
    return final


def _write(tmp: Path, state: Mapping[str, Stateful | DirectoryState], dims: ParallelDims, step: int) -> None:
    """Every rank's files of one checkpoint but trainer.json, into ``tmp``."""
    entries = {name: entry for name, entry in state.items() if name != META_ENTRY}
    components = [name for name, entry in entries.items() if not isinstance(entry, DirectoryState)]
    if dims.rank == 0:
        tmp.mkdir(parents=True)
        for name in components:
            (tmp / "components" / name).mkdir(parents=True)
    _barrier(dims)
    for name, entry in entries.items():
        if isinstance(entry, DirectoryState):
            entry.save_to(tmp, dims, step)
            continue
        save_component(tmp, name, entry, dims)
        if name == components[-1]:
            fail_point("checkpoint.after_components", step)


def save_component(path: Path, name: str, component: Stateful, dims: ParallelDims) -> None:
    """This rank's part of one component (its folder must exist)."""
    torch.save(encode_state(component.state_dict()), Path(path) / "components" / name / rank_file(dims.rank))


def load_checkpoint(path: Path, state: Mapping[str, Stateful | DirectoryState], dims: ParallelDims) -> None:
    """Collective: every entry of ``state`` restored from the complete checkpoint ``path`` into this
    run's layout (any world size): the trainer's position first, whatever the mapping's order (other
    entries may read it), then the others in the mapping's order."""
    if META_ENTRY in state:
        state[META_ENTRY].load_state_dict(read_trainer_meta(path))
    for name, entry in state.items():
        if name == META_ENTRY:
            continue
        if isinstance(entry, DirectoryState):
            entry.load_from(Path(path), dims)
        else:
            load_component(path, name, entry, dims, dims.device)


def load_component(path: Path, name: str, component: Stateful, dims: ParallelDims, device: torch.device) -> None:
    """Restore one component into this run's layout (any world size)."""
    folder = Path(path) / "components" / name
    files = sorted(folder.glob("rank-*.pt"))
    if not files:
        raise FileNotFoundError(f"{folder}: the checkpoint has no state for '{name}'")
    saved = [load_data(f, map_location="cpu", mmap=True) for f in files]
    own_file = folder / rank_file(dims.rank)
    own = saved[files.index(own_file)] if own_file in files else saved[0]
    component.load_state_dict(decode_state(component.state_dict(), saved, own, "", device))
