"""`instcls merge-shards s3://bucket/prefix`: the merge of ``data_pipeline.ingest.shard_merge`` on a set
whose parts uploaded their shards and records to S3.

The plan and every record are fetched into a fresh directory under the staging directory, the sample
table, the skipped report and the manifest are written there exactly as a merge on disk writes
them (so the manifest's bytes, and its digest, are those of the same ingest on disk), and uploaded:
the manifest last, so a reader that finds it finds every file it names.  A shard counts as written
only once its record is on S3 and its tar there has the recorded size.  The directory is removed
afterwards; running the merge again uploads the same bytes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from data_pipeline.ingest.ingest_state import IngestPlan, ShardRecord
from data_pipeline.ingest.s3_staging import PLAN_KEY, done_on_s3, fetch_records, recorded_shards, staging_dir
from data_pipeline.ingest.shard_merge import merge_records
from data_pipeline.shardset.manifest import MANIFEST_NAME, ShardManifest
from data_pipeline.storage.s3_store import S3Store
from data_pipeline.storage.shard_url import S3Url
from data_pipeline.storage.stores import open_store


class S3Records:
    """The plan and records of the ingest at ``url``, fetched into ``out_dir`` at each ``refresh``
    (only the records not fetched yet: a merge that waits for its parts lists the prefix each poll)."""

    def __init__(self, url: S3Url, out_dir: Path, store: S3Store) -> None:
        self.url, self.out_dir, self.store = url, out_dir, store
        self.where = str(url)
        self.remote: dict[str, int] = {}

    def refresh(self) -> None:
        self.remote = self.store.list()
        fetch_records(self.store, recorded_shards(self.remote), self.out_dir)

    def plan(self) -> IngestPlan:
        if PLAN_KEY not in self.remote:
            raise FileNotFoundError(f"{self.url.child(PLAN_KEY)} not found: {self.url} holds no ingest to merge; run "
                                    f"`instcls make-shards --out {self.url} ...` (with --part I/K on each machine) "
                                    "first")
        return IngestPlan(**json.loads(self.store.read_bytes(PLAN_KEY)))

    def record(self, number: int) -> ShardRecord | None:
        return done_on_s3(self.out_dir, number, self.remote)


def merge_on_s3(url: S3Url, staging: Path | str | None = None, wait_seconds: float = 0.0,
                poll_seconds: float = 10.0) -> ShardManifest:
    """Merge the ingest at ``url`` (waiting ``wait_seconds`` for its parts) and upload the result."""
    store = open_store(url)
    root = staging_dir(url, staging)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".merge-", dir=root))
    try:
        manifest = merge_records(S3Records(url, work, store), wait_seconds, poll_seconds)
        for name in (manifest.skipped_report, manifest.table, MANIFEST_NAME):  # the manifest last
            store.upload(work / name, name)
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)
