"""A checkpoint's files: where they are, which checkpoints are complete and which are sound.

Layout of ``<dir>/step_000001234/`` (written as ``step_000001234.tmp/`` and renamed by rank 0 only
when every rank has finished, so a directory without ``.tmp`` is always complete)::

    trainer.json                    the trainer's position (epoch, step, ...) and the world layout
    manifest.json                   bytes and CRC-32 of every other file (damage is found on resume)
    deepspeed/                      DeepSpeed engine state (saved by all ranks)
    model.pt                        consolidated fp32 backbone + head (for eval and resharding)
    optimizer.pt                    the backbone optimizer's state by parameter name, whole (resharding)
    components/NAME/rank-XXXXX.pt   each component's own state (objective, sampler, ...) but its rows
    components/NAME/rows/           its row-sharded tensors: a DCP checkpoint (``row_checkpoint``)
    rng/rank-XXXXX.pt               python / numpy / torch RNG states of each rank

Each rank computes the CRC-32 of the files it wrote; rank 0 puts them together into the manifest.

``--resume auto`` takes the newest complete checkpoint whose files match its manifest; a damaged
one (a truncated or altered file, a file gone) is reported by file and the previous one is used.
The directory must be on storage every rank sees.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

from trainer.checkpoint.safe_load import load_data
from trainer.parallel import ParallelDims
from trainer.parallel.rank0_work import run_on_rank0

_NAME = re.compile(r"^step_(\d{9})$")
MANIFEST = "manifest.json"
TRAINER_FILE = "trainer.json"
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
_CRC_BLOCK = 8 << 20


def checkpoint_name(step: int) -> str:
    return f"step_{step:09d}"


def rank_file(rank: int) -> str:
    """The name of one rank's file in a per-rank folder of a checkpoint."""
    return f"rank-{rank:05d}.pt"


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not Path(directory).is_dir():
        return []
    found = [
        p for p in Path(directory).iterdir() if p.is_dir() and _NAME.match(p.name) and (p / TRAINER_FILE).is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as file:
        while block := file.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def file_checksums(path: Path, files) -> dict[str, dict]:
    """``{name: {bytes, crc32}}`` of ``files`` (relative to the checkpoint ``path``): each rank
    computes those of the files it wrote."""
    path = Path(path)
    return {str(name): {"bytes": (path / name).stat().st_size, "crc32": _crc32(path / name)} for name in files}


def write_manifest(path: Path, entries: dict[str, dict] | None = None) -> None:
    """``manifest.json``: bytes and CRC-32 of every file of the checkpoint but itself and
    trainer.json.  ``entries``: what the ranks computed for their own files; files no rank named
    (DeepSpeed's recovery scripts) are checksummed here.  None: every file is checksummed here."""
    path = Path(path)
    entries = dict(entries or {})
    files = sorted(
        str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and f.name not in (MANIFEST, TRAINER_FILE)
    )
    entries.update(file_checksums(path, [name for name in files if name not in entries]))
    (path / MANIFEST).write_text(json.dumps(dict(sorted(entries.items())), indent=0))


def checkpoint_bytes(path: Path) -> int:
    """A complete checkpoint's size on disk: from its manifest (one small file read) when it has
    one, so that 64 ranks sizing the previous checkpoint at every save do not each walk and stat
    its thousands of files on a shared filesystem; by walking it otherwise (older checkpoints)."""
    path = Path(path)
    try:
        entries = json.loads((path / MANIFEST).read_text())
        extra = sum((path / name).stat().st_size for name in (MANIFEST, TRAINER_FILE) if (path / name).is_file())
        return sum(int(entry["bytes"]) for entry in entries.values()) + extra
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


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
            raise RuntimeError(
                f"--resume auto: every checkpoint in {directory} is damaged ({'; '.join(damaged)}); "
                "restore one from a backup, or start over with --resume none"
            )
        return None
    path = Path(resume)
    if not (path / TRAINER_FILE).is_file():
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (no {TRAINER_FILE}); use --resume auto")
    problem = checkpoint_damage(path)
    if problem is not None:
        raise RuntimeError(
            f"--resume {resume}: the checkpoint is damaged: {problem}; use an earlier one or --resume auto"
        )
    return path


def resolve_resume_on_rank0(resume: str | None, directory: Path, dims: ParallelDims, log=print) -> Path | None:
    """``resolve_resume`` run once (rank 0 reads the files), its answer sent to every rank, which
    wait for it without a collective deadline (checksumming a large checkpoint takes a while)."""

    def resolve() -> Path | Exception | None:
        try:
            return resolve_resume(resume, directory, log)
        except (RuntimeError, FileNotFoundError) as error:
            return error  # raised on every rank alike

    answer = run_on_rank0(resolve, dims.control_group if dims.is_distributed else None)
    if isinstance(answer, Exception):
        raise answer
    return answer


def read_trainer_meta(path: Path) -> dict:
    """The checkpoint's trainer.json: the trainer's position and the world layout that wrote it."""
    return json.loads((Path(path) / TRAINER_FILE).read_text())


def load_model_weights(checkpoint_dir: Path) -> dict:
    """The trained network's fp32 weights (backbone + head) as a state dict, on the CPU."""
    return load_data(Path(checkpoint_dir) / MODEL_FILE, map_location="cpu")
