"""`instcls validate-shards`: prove a shard set is safe to train on before a job meets it.

Checks the manifest's checksums (tars and sample table), that each DALI index file lists exactly
what its tar holds, that every row of the sample table points at an image component of its shard
(each sample once), that every such image decodes, that labels agree with the ``.cls``
components, and that the table's rows are the manifest's shards in order, so ids are exactly
0..N-1 once each.  Every problem is reported by shard and key.  An ``s3://`` set is read through
its store: each tar with one GET (hashed, scanned and checked in memory), each index whole, and the
sample table once per node into the table cache, where its sha256 is checked.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from dataclasses import dataclass, field
from multiprocessing import Pool
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image

from data_pipeline.ingest.ingest_progress import IngestProgress
from data_pipeline.shardset.legacy_table import legacy_shard_rows
from data_pipeline.shardset.manifest import ShardEntry, ShardManifest
from data_pipeline.shardset.set_files import load_manifest, local_table
from data_pipeline.shardset.table_file import TableError, open_table, sha256_of, sha256_of_stream
from data_pipeline.shardset.tar_index import parse_dali_index, read_dali_index, scan_tar
from data_pipeline.shardset.tar_labels import IMAGE_EXTENSIONS, parse_label
from data_pipeline.storage.shard_url import S3Url, ShardLocation, shard_location
from data_pipeline.storage.storage_errors import BucketNotFoundError, StorageAccessError, StorageUnavailableError
from data_pipeline.storage.storage_settings import StorageSettings, storage_settings
from data_pipeline.storage.stores import open_store


@dataclass
class ShardReport:
    tar: str
    checked: int = 0
    problems: list[str] = field(default_factory=list)


def _index_problem(entry: ShardEntry, listed, held) -> str | None:
    if len(listed) != len(held):
        return f"{entry.index}: lists {len(listed)} samples, {entry.tar} holds {len(held)}; re-index the tar"
    for at, (a, b) in enumerate(zip(listed, held)):
        if a.components != b.components:
            return f"{entry.index}: sample {at} ({b.key}) differs from {entry.tar}'s members; re-index the tar"
    return None


def _image_problem(data: bytes) -> str | None:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except Exception as error:  # PIL raises many types for bad data
        return f"image does not decode ({type(error).__name__}: {error})"
    return None


def _open_tar(location: ShardLocation, settings: StorageSettings | None, relative: str) -> BinaryIO | None:
    """The tar ``relative`` of the set, None when it is not there: the local file, or an S3 object
    read whole with one GET (a worker holds one shard in memory, ~100 MB at 1,000 images of 100 KB)."""
    if not isinstance(location, S3Url):
        path = Path(location) / relative
        return open(path, "rb") if path.is_file() else None
    try:
        return io.BytesIO(open_store(location, settings).read_bytes(relative))
    except BucketNotFoundError:
        raise
    except FileNotFoundError:
        return None


def _read_index(location: ShardLocation, settings: StorageSettings | None, relative: str):
    if not isinstance(location, S3Url):
        return read_dali_index(Path(location) / relative)
    store = open_store(location, settings)
    return parse_dali_index(store.read_bytes(relative).decode(), store.describe(relative))


def _sha256_of_handle(handle: BinaryIO) -> str:
    """The tar's digest from its start, leaving the handle at its start for the scan that follows."""
    handle.seek(0)
    digest = sha256_of_stream(handle)
    handle.seek(0)
    return digest


def check_shard(job: tuple[ShardLocation, StorageSettings | None, ShardEntry, np.ndarray | None]) -> ShardReport:
    """``job``: the set's location (a directory or ``s3://``) and its storage settings, the entry,
    and its rows of the table (None for a format-1 set, whose rows come from its index file)."""
    location, settings, entry, rows = job
    report = ShardReport(entry.tar)
    tar = _open_tar(location, settings, entry.tar)
    if tar is None:
        report.problems.append(f"{entry.tar}: file missing (listed in the manifest)")
        return report
    with tar:
        _check_open_shard(location, settings, entry, rows, tar, report)
    return report


def _check_open_shard(location, settings, entry: ShardEntry, rows, tar: BinaryIO, report: ShardReport) -> None:
    if _sha256_of_handle(tar) != entry.sha256:
        report.problems.append(f"{entry.tar}: sha256 differs from the manifest (file changed or truncated)")
    try:
        held = scan_tar(tar)
    except (tarfile.TarError, OSError, EOFError) as error:
        report.problems.append(f"{entry.tar}: unreadable tar ({error})")
        return
    try:
        listed = _read_index(location, settings, entry.index)
        problem = _index_problem(entry, listed, held)
    except (StorageUnavailableError, StorageAccessError):
        raise  # the store, not the set: the command stops naming the fix
    except (OSError, ValueError) as error:
        problem = f"{entry.index}: DALI index unreadable ({error}); re-index the tar"
    if problem:
        report.problems.append(problem)
    if rows is None:
        try:
            rows = legacy_shard_rows(location, entry)[1]
        except (OSError, ValueError) as error:
            report.problems.append(str(error))
            return
    if len(rows) != entry.count:
        report.problems.append(f"{entry.tar}: {len(rows)} table rows, the manifest says {entry.count}")
    where = {component.offset: (sample, component) for sample in held for component in sample.components}
    used: set[str] = set()
    for at, row in enumerate(rows):
        found = where.get(int(row["offset"]))
        sample_id = entry.first_id + at
        if found is None or found[1].extension not in IMAGE_EXTENSIONS or found[1].size != row["size"]:
            report.problems.append(f"{entry.tar}: id {sample_id} points at byte {row['offset']}, where no image "
                                   f"of {row['size']} bytes starts; rebuild the sample table")
            continue
        sample, image = found
        if sample.key in used:
            report.problems.append(f"{entry.tar} key {sample.key}: listed twice in the sample table")
        used.add(sample.key)
        tar.seek(image.offset)
        problem = _image_problem(tar.read(image.size))
        label = sample.find("cls")
        if problem is None and label is not None and row["label"] != -1:
            tar.seek(label.offset)
            stored = parse_label(tar.read(label.size))
            if stored != row["label"]:
                problem = f"label {row['label']} in the sample table, {stored} in .cls"
        if problem:
            report.problems.append(f"{entry.tar} key {sample.key}: {problem}")
        report.checked += 1


def _table_problems(location: ShardLocation, manifest: ShardManifest) -> tuple[np.ndarray | None, list[str]]:
    rebuild = f"rebuild it with `instcls merge-shards {location}`"
    problems = []
    if isinstance(location, S3Url):
        try:  # downloaded once per node into the table cache, and its sha256 checked there
            path = local_table(location, manifest, rebuild)
        except (StorageUnavailableError, StorageAccessError):
            raise
        except (FileNotFoundError, ValueError) as error:
            return None, [str(error)]
    else:
        path = Path(location) / manifest.table
    try:
        table = open_table(path, manifest.num_instances, rebuild)
    except TableError as error:
        return None, [str(error)]
    if isinstance(location, S3Url):  # the bucket's copy, not the node's cached one, which may be older
        remote = hashlib.sha256(open_store(location).read_bytes(manifest.table)).hexdigest()
        if remote != manifest.table_sha256:
            problems.append(f"{location.child(manifest.table)}: sha256 differs from the manifest (object changed "
                            "or truncated)")
    elif sha256_of(path) != manifest.table_sha256:
        problems.append(f"{path}: sha256 differs from the manifest (file changed or truncated)")
    counts = [entry.count for entry in manifest.shards]
    if sum(counts) != manifest.num_instances:
        problems.append(f"manifest.json: shards hold {sum(counts)} samples, num_instances says "
                        f"{manifest.num_instances}")
        return None, problems
    owners = np.repeat(np.arange(len(counts), dtype=np.uint32), counts)
    wrong = np.flatnonzero(table["shard"] != owners)
    if wrong.size:
        problems.append(
            f"{path}: {wrong.size} row(s) lie in another shard than the manifest's id ranges say, e.g. "
            f"ids {wrong[:5].tolist()}"
        )
    return table, problems


def validate_shards(shard_dir: ShardLocation | str, workers: int = 2, progress: bool = True) -> tuple[int, list[str]]:
    """``(samples checked, problems)``; no problems means the set is safe to train on.  ``shard_dir``:
    a directory or an ``s3://`` prefix, read through its store."""
    location = shard_location(shard_dir)
    manifest = load_manifest(location)
    settings = storage_settings() if isinstance(location, S3Url) else None  # the workers' too
    if manifest.legacy and isinstance(location, S3Url):
        raise ValueError(f"{location} was written by an older make-shards and has no sample table: run "
                         "`instcls upgrade-shards DIR` on a local copy, copy the set back, then validate it")
    problems: list[str] = []
    table = None
    if not manifest.legacy:
        table, problems = _table_problems(location, manifest)
    entries = sorted(manifest.shards, key=lambda entry: entry.first_id) if manifest.legacy else manifest.shards
    jobs = [
        (location, settings, entry,
         None if table is None else np.array(table[entry.first_id : entry.first_id + entry.count]))
        for entry in entries
    ]
    if table is None and not manifest.legacy:
        return 0, problems
    checked = 0
    # a bar on a terminal, plain lines in a file or a pod log (never carriage returns)
    shown = IngestProgress("validate-shards", len(jobs), 0, "shards", enabled=progress)
    with Pool(workers) as pool:
        for report in pool.imap(check_shard, jobs):
            problems += report.problems
            checked += report.checked
            shown.advance(1)
    shown.close()
    return checked, problems
