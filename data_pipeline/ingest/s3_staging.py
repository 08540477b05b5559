"""The local staging directory of an ingest to ``s3://``, and the moves between it and the bucket.

A shard set on S3 has the layout it has on disk, ``.ingest/`` records included, so every part and
the merge learn what is done from the bucket alone.  The staging directory mirrors the part of it a
machine works on: the plan, the records it wrote or fetched, and the shards it is writing.  Its
default, ``<temp dir>/instcls-staging/<bucket>/<prefix>``, is stable across runs on one machine (a
killed run finds its finished-but-unuploaded shards there); ``--staging DIR`` puts it elsewhere,
e.g. on a volume that outlives a pod.  Nothing there is needed once a shard's record is on S3.
"""

from __future__ import annotations

import posixpath
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from data_pipeline.ingest.ingest_state import INGEST_DIR, PLAN_NAME, ShardRecord, finished_record, record_names
from data_pipeline.storage.s3_store import S3Store
from data_pipeline.storage.shard_url import S3Url

STAGING_ROOT = "instcls-staging"
PLAN_KEY = f"{INGEST_DIR}/{PLAN_NAME}"  # relative to the set's prefix, as on disk
FETCH_THREADS = 16  # record downloads in flight: 14k shards' records in seconds, not minutes
_RECORD = re.compile(rf"^{re.escape(INGEST_DIR)}/(\d{{6,}})\.json$")


def staging_dir(url: S3Url, staging: Path | str | None) -> Path:
    """``staging``, or the default for ``url``: ``<temp dir>/instcls-staging/<bucket>/<prefix>``."""
    if staging is not None:
        return Path(staging)
    return Path(tempfile.gettempdir(), STAGING_ROOT, url.bucket, *([url.prefix] if url.prefix else []))


def recorded_shards(remote: dict[str, int]) -> list[int]:
    """The shards whose record is in the listing ``remote`` (``{relative path: size}``)."""
    return sorted(int(match[1]) for match in map(_RECORD.match, remote) if match)


def fetch_records(store: S3Store, numbers: list[int], directory: Path) -> None:
    """Download the records of shards ``numbers`` (each on S3) into ``directory``, unless there
    already: the ``.npy`` first and the ``.json`` last, as the writer leaves them.  A record's bytes
    follow from the plan, which every run checks, so a copy in staging is the one on S3."""

    def fetch(number: int) -> None:
        json_name, npy_name = record_names(number)
        if not (directory / json_name).is_file():
            store.download(npy_name, directory / npy_name)
            store.download(json_name, directory / json_name)

    with ThreadPoolExecutor(FETCH_THREADS) as pool:
        list(pool.map(fetch, numbers))


def done_on_s3(directory: Path, number: int, remote: dict[str, int]) -> ShardRecord | None:
    """The record of shard ``number`` if the shard is whole on S3: its record is listed in
    ``remote`` (uploaded after its other files) and its tar has the size the record says.  The
    record must have been fetched into ``directory``."""
    if record_names(number)[0] not in remote:
        return None
    return finished_record(directory, number, tar_bytes=lambda relative: remote.get(posixpath.normpath(relative)))


def upload_shard(store: S3Store, directory: Path, number: int) -> None:
    """Upload a shard finished in ``directory``: its tar and index, then its record, the ``.json``
    last (so a listed record means a whole shard); then drop the local tar and index.  Uploading
    the same shard again writes the same bytes to the same keys."""
    record = finished_record(directory, number)
    if record is None:
        raise FileNotFoundError(f"{directory}: shard {number} has no finished record to upload; run make-shards "
                                "again (it rewrites the shard)")
    files = [name for name in (record.tar, record.index) if name is not None]
    for name in [*files, *reversed(record_names(number))]:
        store.upload(directory / name, name)
    for name in files:
        (directory / name).unlink(missing_ok=True)
