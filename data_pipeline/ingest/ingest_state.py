"""What an ingest leaves in ``OUT/.ingest`` so that it can stop anywhere and go on, on any machine.

``plan.json`` fixes what the shards will be: the source's listing digest, its size, how it is cut
into shards and the settings that decide their bytes.  Every run (and every ``--part`` on every
machine) checks it is continuing the same plan.  A finished shard leaves a record: ``NNNNNN.npy``
(its samples' byte ranges and labels) and then ``NNNNNN.json`` (its files, checksum and the
images it skipped), each written under a temporary name and renamed, so a record that exists is
complete and its shard is skipped on restart.  The merge (``data_pipeline.ingest.shard_merge``) reads
only these records, never the tars.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from data_pipeline.shardset.table_file import ROW
from trainer.temp_files import temp_sibling

INGEST_DIR = ".ingest"
PLAN_NAME = "plan.json"
PLAN_FORMAT = "instcls-ingest/1"
RECORD_ROW = np.dtype([("size", "<u4"), ("offset", "<u8"), ("label", "<i4")])


@dataclass(frozen=True)
class Part:
    """Part ``index`` of ``count`` (0-based, as a Job's completion index): shards index, index + count, ..."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> "Part":
        match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
        if not match or not int(match[1]) < int(match[2]):
            raise ValueError(f"--part {text!r}: write I/K with 0 <= I < K, e.g. 0/8 for the first of 8 parts")
        return cls(int(match[1]), int(match[2]))

    def shards(self, num_shards: int) -> range:
        return range(self.index, num_shards, self.count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class IngestPlan:
    """Attributes: kind ("images": make-shards encodes them; "tars": existing tars indexed in
    place); source (its name); listing_sha256; count (images or tars listed); num_shards;
    class_names; settings (everything else that decides the shards' bytes)."""

    kind: str
    source: str
    listing_sha256: str
    count: int
    num_shards: int
    class_names: list[str] | None
    settings: dict = field(default_factory=dict)
    format: str = PLAN_FORMAT

    def save_or_check(self, out_dir: Path, fix: str | None = None) -> None:
        """Write the plan, or check that the one in ``out_dir`` is this one (``fix``: what the error
        says to do when it is not; by default, finish it or write elsewhere)."""
        path = ingest_dir(out_dir) / PLAN_NAME
        if path.is_file():
            self.check_against(json.loads(path.read_text()), str(path), fix or (
                f"run with the same inputs and settings to finish it, or write to another --out (or delete "
                f"{Path(out_dir)})"))
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, self.to_bytes())

    def to_bytes(self) -> bytes:
        """The plan file's bytes."""
        return json.dumps(asdict(self), indent=1).encode()

    def check_against(self, found: dict, where: str, fix: str) -> None:
        """``ValueError`` naming ``where`` and every differing field unless the plan ``found``
        there is this one."""
        mine = json.loads(json.dumps(asdict(self)))  # tuples as lists, like the file
        # The source's name holds its path, which may differ between machines that mount the
        # same data elsewhere; the listing digest is what must agree.
        differing = sorted(key for key in mine.keys() | found.keys()
                           if key != "source" and mine.get(key) != found.get(key))
        if differing:
            details = "; ".join(f"{key}: there {_short(found.get(key))}, now {_short(mine.get(key))}"
                                for key in differing)
            raise ValueError(f"{where} plans another ingest ({details}); {fix}")

    @classmethod
    def load(cls, out_dir: Path) -> "IngestPlan":
        path = ingest_dir(out_dir) / PLAN_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: {out_dir} holds no ingest to merge; run `instcls make-shards "
                                    f"--out {out_dir} ...` (with --part I/K on each machine) first")
        return cls(**json.loads(path.read_text()))


@dataclass(frozen=True)
class ShardRecord:
    """A finished shard: ``tar``/``index`` relative to the output directory (None when every image
    was skipped), ``count`` samples, the tar's sha256 and size, and the skipped images."""

    number: int
    tar: str | None
    index: str | None
    count: int
    sha256: str | None
    tar_bytes: int
    skipped: list[dict]


def ingest_dir(out_dir: Path) -> Path:
    return Path(out_dir) / INGEST_DIR


def record_names(number: int) -> tuple[str, str]:
    """The record files of shard ``number``, relative to the output directory: ``(json, npy)``."""
    return f"{INGEST_DIR}/{number:06d}.json", f"{INGEST_DIR}/{number:06d}.npy"


def _record_paths(out_dir: Path, number: int) -> tuple[Path, Path]:
    json_name, npy_name = record_names(number)
    return Path(out_dir) / json_name, Path(out_dir) / npy_name


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = temp_sibling(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def save_record(out_dir: Path, record: ShardRecord, rows: np.ndarray) -> None:
    """``rows``: ``ROW`` records of the shard's samples (their ``shard`` field is set at merge)."""
    json_path, npy_path = _record_paths(out_dir, record.number)
    packed = np.empty(len(rows), dtype=RECORD_ROW)
    for name in RECORD_ROW.names:
        packed[name] = rows[name]
    tmp = temp_sibling(npy_path)
    with open(tmp, "wb") as handle:
        np.save(handle, packed, allow_pickle=False)
    os.replace(tmp, npy_path)
    _write_atomically(json_path, json.dumps(asdict(record)).encode())  # last: the shard is done


def finished_record(out_dir: Path, number: int,
                    tar_bytes: Callable[[str], int | None] | None = None) -> ShardRecord | None:
    """The record of shard ``number``, or None if the shard is not done (no record, or its tar is
    missing or of another size than when it was written).  ``tar_bytes(relative)``: the size of
    the tar where the set lives, None if it is not there (default: the file's in ``out_dir``)."""
    json_path, _ = _record_paths(out_dir, number)
    if not json_path.is_file():
        return None
    record = ShardRecord(**json.loads(json_path.read_text()))
    if record.tar is not None:
        size = (tar_bytes or partial(_local_size, Path(out_dir)))(record.tar)
        if size != record.tar_bytes:
            return None
    return record


def _local_size(out_dir: Path, relative: str) -> int | None:
    path = out_dir / relative
    return path.stat().st_size if path.is_file() else None


def load_rows(out_dir: Path, record: ShardRecord) -> np.ndarray:
    """The ``ROW`` records of a finished shard's samples (``shard`` left 0)."""
    _, npy_path = _record_paths(out_dir, record.number)
    packed = np.load(npy_path, allow_pickle=False)
    if packed.dtype != RECORD_ROW or len(packed) != record.count:
        raise ValueError(f"{npy_path}: {len(packed)} rows of {packed.dtype}, its record says {record.count} of "
                         f"{RECORD_ROW}; delete it and its .json and run the ingest again (that shard is rewritten)")
    rows = np.zeros(len(packed), dtype=ROW)
    for name in RECORD_ROW.names:
        rows[name] = packed[name]
    return rows


def remove_leftovers(out_dir: Path, names: list[str]) -> None:
    """Temporary files a killed run left for the shards ``names`` (this part's unfinished ones)."""
    for name in names:
        for leftover in Path(out_dir).glob(f"{name}.*.tmp-*"):
            leftover.unlink(missing_ok=True)
