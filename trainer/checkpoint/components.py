"""Saving and loading a checkpoint: one mapping of named entries, written atomically.

Every rank writes into ``step_N.tmp/``; rank 0 writes the manifest and ``trainer.json`` once all
ranks are done and renames the directory (the layout: ``trainer.checkpoint.checkpoint_files``).  A
save is planned here, on the training thread (``plan_checkpoint``: each entry's state as a list of
writes, ``trainer.checkpoint.save_plan``), and written by ``trainer.checkpoint.async_checkpoint``,
in the background or while the caller waits.

Entries are saved and loaded in the mapping's order (so the RNG, restored last, is not drawn
from afterwards), and this module knows none of them by name but ``trainer``: the trainer's
position, written last as ``trainer.json`` and loaded first, since others may read it.  A
``DirectoryState`` entry plans its own files (the engine: ``trainer.checkpoint.engine_state``; the RNG:
``trainer.checkpoint.rng_state``).  Any other entry is a ``Stateful`` whose state each rank writes to
``components/NAME/``: tensors in it wrapped in ``ShardedRows`` go to ``components/NAME/rows/``
through DCP and are re-split by row on load (``trainer.parallel.sharded_state``,
``trainer.checkpoint.row_checkpoint``), so a checkpoint written by T ranks loads on any T'.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from trainer.checkpoint.checkpoint_files import checkpoint_name, complete_checkpoints, rank_file, read_trainer_meta
from trainer.checkpoint.row_checkpoint import ROWS_FOLDER, check_covered, load_rows, read_metadata, target_rows
from trainer.checkpoint.safe_load import load_data
from trainer.checkpoint.save_guard import SpacePlan, check_space
from trainer.checkpoint.save_plan import FailPoint, FileWrite, RowsWrite, SavePlan, unstaged, write_plan
from trainer.parallel import ParallelDims
from trainer.parallel.sharded_state import (
    ShardedRows,
    assemble_rows,
    decode_state,
    has_inline_rows,
    names_rows,
    rows_node,
    split_state,
)

META_ENTRY = "trainer"  # the entry written as trainer.json


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class DirectoryState(Protocol):
    """An entry that decides its own files (every rank calls both).  ``snapshot`` may run
    collectives (it runs on the training thread) and returns the writes, with live tensors; the
    files it names are relative to the checkpoint directory ``path`` (being written)."""

    def snapshot(self, path: Path, dims: ParallelDims, step: int) -> SavePlan: ...

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
            raise ValueError(f"the checkpoint's trainer.json lacks {missing}; was it written by another version?")
        for name in vars(self.fields):
            setattr(self.fields, name, state[name])


@dataclass
class SaveJob:
    """One save, planned: where it goes, its writes, its ``trainer.json`` and its space check."""

    step: int
    final: Path
    tmp: Path
    plan: SavePlan
    meta: dict
    space: SpacePlan


def _barrier(dims: ParallelDims) -> None:
    if dims.is_distributed:
        dist.barrier(group=dims.control_group)


def plan_checkpoint(directory: Path, step: int, state: Mapping[str, Stateful | DirectoryState],
                    dims: ParallelDims) -> SaveJob:
    """Collective, on the training thread: the space check, ``step_N.tmp/``, and every entry's
    writes (with live tensors: stage them or write them before training goes on)."""
    directory = Path(directory)
    final = directory / checkpoint_name(step)
    tmp = final.with_name(final.name + ".tmp")
    if dims.rank == 0:
        for partial in directory.glob("step_*.tmp"):  # left by a run that died while saving
            shutil.rmtree(partial, ignore_errors=True)
    previous = complete_checkpoints(directory)
    space = check_space(directory, final, previous[-1] if previous else None, dims)
    entries = {name: entry for name, entry in state.items() if name != META_ENTRY}
    components = [name for name, entry in entries.items() if not isinstance(entry, DirectoryState)]
    plan: SavePlan = []
    with space.reporting_failures(tmp, dims.rank):
        if dims.rank == 0:
            tmp.mkdir(parents=True)
        _barrier(dims)
        for name, entry in entries.items():
            if isinstance(entry, DirectoryState):
                plan += entry.snapshot(tmp, dims, step)
                continue
            plan += component_plan(name, entry, dims)
            if name == components[-1]:
                plan.append(FailPoint("checkpoint.after_components"))
    meta = state[META_ENTRY].state_dict() if META_ENTRY in state else {}
    meta = dict(meta, world_size=dims.world_size, classifier_parallel_size=dims.classifier_parallel_size)
    return SaveJob(step, final, tmp, plan, meta, space)


def component_plan(name: str, component: Stateful, dims: ParallelDims) -> SavePlan:
    """This rank's writes of one component: its plain state, then its rows (a DCP save, collective)."""
    plain, rows = split_state(component.state_dict())
    folder = f"components/{name}"
    plan: SavePlan = [FileWrite(f"{folder}/{rank_file(dims.rank)}", plain)]
    if names_rows(plain):
        plan.append(RowsWrite(f"{folder}/{ROWS_FOLDER}", rows))
    return plan


def save_component(path: Path, name: str, component: Stateful, dims: ParallelDims) -> None:
    """This rank's part of one component, written at once (collective when it has rows)."""
    write_plan(Path(path), unstaged(component_plan(name, component, dims)), None, dims.control_group)


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
    """Restore one component into this run's layout (any world size; collective when it has rows)."""
    folder = Path(path) / "components" / name
    files = sorted(folder.glob("rank-*.pt"))
    if not files:
        raise FileNotFoundError(f"{folder}: the checkpoint has no state for '{name}'")
    own_file = folder / rank_file(dims.rank)
    own = load_data(own_file if own_file in files else files[0], map_location="cpu", mmap=True)
    rows_folder = folder / ROWS_FOLDER
    metadata = read_metadata(rows_folder) if rows_folder.is_dir() else None
    targets: dict[str, tuple[torch.Tensor, int]] = {}
    legacy: list[dict] = []

    def read_rows(template: ShardedRows, node: dict, where: str):
        if has_inline_rows(node):  # written before rows went through DCP: every rank's file holds a piece
            legacy[:] = legacy or [load_data(f, map_location="cpu", mmap=True) for f in files]
            return assemble_rows(template, [rows_node(saved, where) for saved in legacy], where, device)
        if metadata is None or node["key"] not in metadata.state_dict_metadata:
            if node["present"]:
                raise ValueError(f"{rows_folder}: the checkpoint lacks the rows of {where}; it is incomplete: resume "
                                 "from an earlier one")
            return None
        check_covered(metadata, node["key"], template.start, template.end, where)
        target = target_rows(metadata, node["key"], template.rows, template.start, template.end, device)
        targets[node["key"]] = (target, template.start)
        return target

    state = decode_state(component.state_dict(), own, "", read_rows)
    if metadata is not None:  # every rank: the folder is there for all or none
        load_rows(rows_folder, metadata, targets, dims.control_group if dims.is_distributed else None)
    component.load_state_dict(state)
