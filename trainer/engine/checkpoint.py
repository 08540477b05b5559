"""Checkpoints that survive preemption and changes of world size.

Layout of ``<dir>/step_000001234/`` (written as ``step_000001234.tmp/`` and renamed by rank 0 only
when every rank has finished, so a directory without ``.tmp`` is always complete)::

    trainer.json                    the trainer's state (epoch, step, ...) and the world layout
    manifest.json                   bytes and CRC-32 of every other file (damage is found on resume)
    deepspeed/                      DeepSpeed engine state (saved by all ranks)
    model.pt                        consolidated fp32 backbone + head (for eval and resharding)
    optimizer.pt                    the backbone optimizer's state by parameter name, whole (resharding)
    components/NAME/rank-XXXXX.pt   each component's own state (objective, sampler, ...)
    rng/rank-XXXXX.pt               python / numpy / torch RNG states of each rank

Components are objects with ``state_dict()`` / ``load_state_dict()``; this module knows none of
them by name.  In a component's state, tensors wrapped in ``ShardedRows`` are rows
``[start, end)`` of a larger tensor: each row is written once (by its ``primary`` holder), and on
load every rank reads the rows its *live* component asks for from whichever saved files hold
them, so a checkpoint written by T ranks loads on any T'.  Other values are read back from the
same rank's file, or rank 0's when that rank did not exist.  With the same world size the
DeepSpeed state restores the backbone exactly; with another, the backbone weights come from
``model.pt`` and its optimizer state (SGD's momentum) from ``optimizer.pt``, put into the
new ZeRO partitioning by DeepSpeed's accessors (``trainer.engine.optimizer_state``).  The directory
must be on storage every rank sees.

``--resume auto`` takes the newest complete checkpoint whose files match its manifest; a damaged
one (a truncated or altered file, a file gone) is reported by file and the previous one is used.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from trainer.engine.failpoints import fail_point
from trainer.engine.optimizer_state import full_optimizer_state, load_full_optimizer_state, load_master_weights
from trainer.engine.safe_load import load_data, refuse_pickled_code
from trainer.objectives.base import ShardedRows
from trainer.parallel import ParallelDims

_NAME = re.compile(r"^step_(\d{9})$")
MANIFEST = "manifest.json"
OPTIMIZER_FILE = "optimizer.pt"
_CRC_BLOCK = 8 << 20
_ROWS_TAG = "__sharded_rows__"


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _barrier(dims: ParallelDims) -> None:
    if dims.is_distributed:
        dist.barrier(group=dims.control_group)


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not Path(directory).is_dir():
        return []
    found = [p for p in Path(directory).iterdir() if p.is_dir() and _NAME.match(p.name) and (p / "trainer.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as file:
        while block := file.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def write_manifest(path: Path) -> None:
    """``manifest.json``: bytes and CRC-32 of every file of the checkpoint (rank 0, once all ranks wrote)."""
    path = Path(path)
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.name not in (MANIFEST, "trainer.json"))
    entries = {str(f.relative_to(path)): {"bytes": f.stat().st_size, "crc32": _crc32(f)} for f in files}
    (path / MANIFEST).write_text(json.dumps(entries, indent=0))


def checkpoint_damage(path: Path) -> str | None:
    """What is wrong with a complete checkpoint's files, or None (also for one without a manifest,
    written before manifests existed)."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None
    try:
        entries = json.loads(manifest.read_text())
    except (OSError, ValueError) as error:
        return f"{manifest} is unreadable ({error})"
    for name, expected in entries.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        size = file.stat().st_size
        if size != expected["bytes"]:
            return f"{file} has {size} bytes, the manifest says {expected['bytes']} (truncated or rewritten)"
        if _crc32(file) != expected["crc32"]:
            return f"{file} does not match its CRC-32 in the manifest (its bytes changed after the save)"
    return None


def resolve_resume(resume: str | None, directory: Path, log=print) -> Path | None:
    """``None``/"none" -> start fresh; "auto" -> newest undamaged complete checkpoint (or fresh when
    there is none at all); else that path, which must be complete and undamaged."""
    if resume in (None, "none"):
        return None
    if resume == "auto":
        found = complete_checkpoints(directory)
        damaged = []
        for path in reversed(found):
            problem = checkpoint_damage(path)
            if problem is None:
                return path
            damaged.append(problem)
            log(f"checkpoint {path} is damaged: {problem}; trying the one before it")
        if damaged:
            raise RuntimeError(f"--resume auto: every checkpoint in {directory} is damaged ({'; '.join(damaged)}); "
                               "restore one from a backup, or start over with --resume none")
        return None
    path = Path(resume)
    if not (path / "trainer.json").is_file():
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (no trainer.json); use --resume auto")
    problem = checkpoint_damage(path)
    if problem is not None:
        raise RuntimeError(f"--resume {resume}: the checkpoint is damaged: {problem}; use an earlier one or --resume auto")
    return path


def resolve_resume_on_rank0(resume: str | None, directory: Path, dims: ParallelDims, log=print) -> Path | None:
    """``resolve_resume`` run once (rank 0 reads the files), its answer sent to every rank."""
    answer = [None]
    if dims.rank == 0:
        try:
            answer[0] = resolve_resume(resume, directory, log)
        except (RuntimeError, FileNotFoundError) as error:
            answer[0] = error
    if dims.is_distributed:
        dist.broadcast_object_list(answer, src=0, group=dims.control_group)
    if isinstance(answer[0], Exception):
        raise answer[0]
    return answer[0]


def checkpoint_name(step: int) -> str:
    return f"step_{step:09d}"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


# -- encoding a component's state (ShardedRows <-> plain dicts that weights_only loading accepts) --

def _encode(value):
    if isinstance(value, ShardedRows):
        rows = value.rows.detach().cpu() if value.rows is not None and value.primary else None
        return {_ROWS_TAG: True, "start": value.start, "end": value.end, "total": value.total,
                "present": value.rows is not None, "rows": rows}
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return value


def _is_rows(value) -> bool:
    return isinstance(value, dict) and value.get(_ROWS_TAG) is True


def _decode(template, saved_files: list[dict], own: dict, path: str, device: torch.device):
    """The live ``template`` filled from the saved files (``own``: this rank's, or rank 0's)."""
    if isinstance(template, ShardedRows):
        return ShardedRows(_assemble_rows(template, saved_files, path, device), template.start, template.end,
                           template.total, template.primary)
    if isinstance(template, dict):
        if not isinstance(own, dict):
            raise ValueError(f"checkpoint state {path or 'root'} is not a mapping; was it written by another version?")
        missing = [key for key in template if key not in own]
        if missing:
            raise ValueError(f"checkpoint state {path or 'root'} lacks {missing}; was it written by another objective?")
        return {key: _decode(template[key], [f[key] for f in saved_files], own[key], _join(path, key), device)
                for key in template}
    return own


def _assemble_rows(template: ShardedRows, saved: list[dict], path: str, device: torch.device):
    """Rows ``[template.start, template.end)`` from whichever saved pieces cover them (None if the
    state did not exist when the checkpoint was written)."""
    if not all(_is_rows(piece) for piece in saved):
        raise ValueError(f"checkpoint state {path} is not row-sharded")
    if saved[0]["total"] != template.total:
        raise ValueError(f"checkpoint state {path} has {saved[0]['total']} rows but this run needs {template.total} "
                         "(a different data set?); resume with the shard set the checkpoint was trained on")
    if not saved[0]["present"]:
        return None
    pieces, covered = [], template.start
    for piece in sorted((p for p in saved if p["rows"] is not None), key=lambda p: p["start"]):
        if covered >= template.end:
            break
        hi = min(piece["end"], template.end)
        if piece["start"] > covered:
            _missing_rows(path, covered, min(piece["start"], template.end))
        if covered < hi:
            pieces.append(piece["rows"][covered - piece["start"] : hi - piece["start"]])
            covered = hi
    if covered < template.end:
        _missing_rows(path, covered, template.end)
    # One piece stays a view of the memory-mapped file (a disk row store copies it block by block),
    # and rows go where the live component keeps them: a host/disk store's never pass the GPU.
    if template.rows is not None:
        device = template.rows.device
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(device)


def _missing_rows(path: str, start: int, end: int):
    raise ValueError(f"checkpoint state {path}: rows [{start}, {end}) are in no saved file; the checkpoint is "
                     "incomplete (a rank's file is missing?): resume from an earlier one")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# -- save / load ---------------------------------------------------------------------------------

def save_checkpoint(directory: Path, step: int, engine, components: dict[str, Stateful], trainer_meta: dict,
                    dims: ParallelDims, keep: int) -> Path:
    """Collective: every rank calls it.  Returns the final path."""
    directory = Path(directory)
    final = directory / checkpoint_name(step)
    tmp = final.with_name(final.name + ".tmp")
    if dims.rank == 0:
        for partial in directory.glob("step_*.tmp"):  # left by a run that died while saving
            shutil.rmtree(partial, ignore_errors=True)
    space = _check_space(directory, final, dims)
    with space.reporting_failures(tmp, dims.rank):
        _write(tmp, engine, components, dims, step)
    _barrier(dims)

    if dims.rank == 0:
        with space.reporting_failures(tmp, dims.rank):
            write_manifest(tmp)
            meta = dict(trainer_meta, world_size=dims.world_size, classifier_parallel_size=dims.classifier_parallel_size)
            (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
            fail_point("checkpoint.before_rename", step)
            if final.exists():  # the same step from an earlier run started with --resume none
                shutil.rmtree(final)
            os.replace(tmp, final)
        fail_point("checkpoint.after_rename", step)
        for old in complete_checkpoints(directory)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(dims)
    return final


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the previous complete one is untouched."""


class CheckpointInterrupted(RuntimeError):
    """Another rank failed while this one was saving; the previous complete checkpoint is untouched."""


def _bytes_in(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@dataclass
class _SpacePlan:
    """What a save expects to need: the size of the newest complete checkpoint (same model, same
    layout), and what the filesystem had free before writing."""

    directory: Path
    previous: Path | None
    expected_bytes: int
    free_bytes: int

    def _advice(self) -> str:
        kept = f"The previous checkpoint {self.previous} is complete and untouched" if self.previous else \
            "There is no earlier complete checkpoint"
        return (f"{kept}. Free space on {self.directory}'s filesystem, lower checkpoint.keep or point checkpoint.dir "
                "at a bigger volume, then resume with --resume auto.")

    @contextmanager
    def reporting_failures(self, tmp: Path, rank: int):
        """Turn a failed write into one clear error; the original text is kept.  ``torch.save``
        reports a full disk as a RuntimeError from its zip writer, so that one is a write failure
        too.  A collective that fails because another rank died (gloo: "Connection reset by peer")
        is not about space: it says so and leaves the partial directory to the next save.  Any
        other RuntimeError is a bug and propagates unchanged."""
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
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the run stops here
            needed = f"about {self.expected_bytes:,} bytes" if self.expected_bytes else "an unknown number of bytes"
            raise CheckpointWriteError(
                f"rank {rank} could not write checkpoint {tmp.with_suffix('')}: {error}. A checkpoint needs {needed}; "
                f"{self.free_bytes:,} bytes were free before the save. " + self._advice()
            ) from None


def _from_torch_save_writer(error: RuntimeError) -> bool:
    return any(mark in str(error) for mark in ("inline_container", "PytorchStreamWriter"))


def _another_rank_failed(error: Exception) -> bool:
    # NCCL raises DistError subclasses; gloo raises a plain RuntimeError naming the lost peer.
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "by peer" in str(error))


def _check_space(directory: Path, final: Path, dims: ParallelDims) -> _SpacePlan:
    """Refuse, on every rank together and before writing anything, a save that cannot fit."""
    previous = complete_checkpoints(directory)
    plan = _SpacePlan(directory, previous[-1] if previous else None, _bytes_in(previous[-1]) if previous else 0,
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


def _write(tmp: Path, engine, components: dict[str, Stateful], dims: ParallelDims, step: int) -> None:
    """Every rank's files of one checkpoint, into ``tmp``."""
    if dims.rank == 0:
        for name in components:
            (tmp / "components" / name).mkdir(parents=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier(dims)

    fail_point("checkpoint.before_engine", step)
    engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
    fail_point("checkpoint.after_engine", step)
    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):  # no-op below ZeRO-3
        if dims.rank == 0:
            full = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
            torch.save(full, tmp / "model.pt")
    optimizer_state = full_optimizer_state(engine, keep=dims.rank == 0)  # collective under ZeRO
    if dims.rank == 0:
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
    for name, component in components.items():
        save_component(tmp, name, component, dims)
    fail_point("checkpoint.after_components", step)
    torch.save(_rng_states(), tmp / "rng" / _rank_file(dims.rank))


def save_component(path: Path, name: str, component: Stateful, dims: ParallelDims) -> None:
    """This rank's part of one component (its folder must exist)."""
    torch.save(_encode(component.state_dict()), Path(path) / "components" / name / _rank_file(dims.rank))


def read_trainer_meta(path: Path) -> dict:
    return json.loads((Path(path) / "trainer.json").read_text())


def load_component(path: Path, name: str, component: Stateful, dims: ParallelDims, device: torch.device) -> None:
    """Restore one component into this run's layout (any world size)."""
    folder = Path(path) / "components" / name
    files = sorted(folder.glob("rank-*.pt"))
    if not files:
        raise FileNotFoundError(f"{folder}: the checkpoint has no state for '{name}'")
    saved = [load_data(f, map_location="cpu", mmap=True) for f in files]
    own_file = folder / _rank_file(dims.rank)
    own = saved[files.index(own_file)] if own_file in files else saved[0]
    component.load_state_dict(_decode(component.state_dict(), saved, own, "", device))


def load_engine(path: Path, engine, dims: ParallelDims, log=print) -> None:
    """The backbone: exact DeepSpeed state on the same world size, else the weights of model.pt."""
    path = Path(path)
    meta = read_trainer_meta(path)
    if meta["world_size"] == dims.world_size:
        refuse_pickled_code(path / "deepspeed")  # DeepSpeed unpickles with weights_only=False
        engine.load_checkpoint(str(path / "deepspeed"), tag="state", load_lr_scheduler_states=False)
        return
    state_dict = load_data(path / "model.pt", map_location="cpu")
    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=0):
        if dims.rank == 0 or engine.zero_optimization_stage() < 3:
            engine.module.load_state_dict(state_dict)
    load_master_weights(engine, state_dict)  # else the first step writes the old master weights back
    optimizer_file = path / OPTIMIZER_FILE
    if not optimizer_file.is_file():  # written before optimizer.pt existed
        log(f"resuming {path} written by {meta['world_size']} ranks on {dims.world_size}: objective state re-split "
            f"by rows; backbone weights from model.pt; it has no {OPTIMIZER_FILE}, so the backbone optimizer's "
            "state restarts")
        return
    missing = load_full_optimizer_state(engine, load_data(optimizer_file, map_location="cpu"))
    log(f"resuming {path} written by {meta['world_size']} ranks on {dims.world_size}: objective state re-split by "
        f"rows; backbone weights from model.pt and optimizer state from {OPTIMIZER_FILE}"
        + (f" ({len(missing)} parameters had none: {', '.join(missing[:3])}...)" if missing else ""))


def _rng_states() -> dict:
    """This process's RNG states as tensors and plain numbers, so loading them runs no pickled code."""
    version, python_state, gauss = random.getstate()
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    states = {
        "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict) -> None:
    python, numpy_state = states["python"], states["numpy"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["position"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def load_rng(path: Path, dims: ParallelDims, seed: int, step: int) -> None:
    """This rank's RNG states when the world size is unchanged, else a fresh seed for (step, rank)."""
    path = Path(path)
    rng_file = path / "rng" / _rank_file(dims.rank)
    if read_trainer_meta(path)["world_size"] == dims.world_size and rng_file.is_file():
        _set_rng_states(load_data(rng_file))
    else:
        reseed(seed, step, dims.rank)


def reseed(seed: int, step: int, rank: int) -> None:
    """Deterministic RNG state for (seed, step, rank)."""
    mixed = (seed * 1_000_003 + step * 997 + rank) % (2**31)
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)
