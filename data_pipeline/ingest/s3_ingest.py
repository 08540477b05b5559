"""`instcls make-shards --out s3://bucket/prefix`: each shard written in a local staging directory
(``data_pipeline.ingest.s3_staging``) as on disk, then uploaded by the worker that wrote it.

What a run finds done, and so never rewrites: a shard whose record is on S3 and whose tar there has
the size the record says.  A shard finished in staging whose upload was cut short (the run killed
between its tar and its record) is uploaded again, not rewritten.  Everything else of the part is
written.  So a pod restart, which loses a staging directory in the pod's temp dir, costs the shards
that were in flight; a rerun of a finished part uploads nothing.  The plan is checked against the
one on S3 (the first part to start uploads it) and against the one in staging.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.ingest.ingest_state import IngestPlan, finished_record
from data_pipeline.ingest.s3_staging import (
    PLAN_KEY,
    done_on_s3,
    fetch_records,
    recorded_shards,
    staging_dir,
    upload_shard,
)
from data_pipeline.shardset.manifest import MANIFEST_NAME, ShardManifest
from data_pipeline.storage.shard_url import S3Url
from data_pipeline.storage.storage_settings import StorageSettings, storage_settings
from data_pipeline.storage.stores import open_store


@dataclass(frozen=True)
class UploadingWork:
    """What a worker process runs per shard: ``work(job)`` writes it in staging (``job.out_dir``),
    then the shard is uploaded.  Picklable: the settings travel with it to the workers."""

    work: Callable[[object], int]
    url: str
    settings: StorageSettings

    def __call__(self, job) -> int:
        count = self.work(job)
        upload_shard(open_store(S3Url(self.url), self.settings), Path(job.out_dir), job.number)
        return count


class S3Ingest:
    """An ingest writing to ``url`` through the staging directory ``directory``.  Made before the
    source is listed: a missing bucket, refused credentials or a finished set stop it at once."""

    def __init__(self, url: S3Url, staging: Path | str | None = None) -> None:
        self.url, self.settings = S3Url(url), storage_settings()
        self.directory = staging_dir(self.url, staging)
        self.store = open_store(self.url, self.settings)
        self.remote = self.store.list()
        if MANIFEST_NAME in self.remote:
            raise FileExistsError(f"{self.url.child(MANIFEST_NAME)} exists: this shard set is complete; write to "
                                  f"another prefix, or delete every object under {self.url}/ first")

    def start(self, plan: IngestPlan) -> None:
        """Check ``plan`` against the set's and the staging directory's, uploading it if first."""
        self.directory.mkdir(parents=True, exist_ok=True)
        stale_staging = (f"{self.directory} holds the state of another ingest: delete it, or pass another "
                         "--staging")
        if PLAN_KEY in self.remote:
            plan.check_against(json.loads(self.store.read_bytes(PLAN_KEY)), self.url.child(PLAN_KEY),
                               "run with the same inputs and settings to finish it, or write to another --out (or "
                               f"delete every object under {self.url}/)")
            plan.save_or_check(self.directory, stale_staging)
        else:
            plan.save_or_check(self.directory, stale_staging)
            self.store.upload(self.directory / PLAN_KEY, PLAN_KEY)

    def finished(self, numbers: list[int]) -> set[int]:
        """Of shards ``numbers``, those done: whole on S3, or finished in staging and uploaded now."""
        recorded = set(recorded_shards(self.remote))
        fetch_records(self.store, [number for number in numbers if number in recorded], self.directory)
        done = set()
        for number in numbers:
            if done_on_s3(self.directory, number, self.remote) is None:
                if finished_record(self.directory, number) is None:
                    continue
                upload_shard(self.store, self.directory, number)  # killed while uploading it
            done.add(number)
        return done

    def job_work(self, work: Callable[[object], int]) -> UploadingWork:
        return UploadingWork(work, str(self.url), self.settings)

    def merge(self) -> ShardManifest:
        from data_pipeline.ingest.s3_merge import merge_on_s3

        return merge_on_s3(self.url, self.directory)
