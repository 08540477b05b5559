"""The merge step: every shard's record -> the sample table, the skipped-images report, the manifest.

Ids are numbered here, 0..N-1 in shard order and, within a shard, in stored order, so they are
the same however many parts or workers wrote the shards.  Only the records are read (14k small
files for ImageNet-21K), never the tars.  The manifest is written last: a shard set without one
is unfinished, and the merge can run again at any time (``instcls merge-shards``).  A set on
``s3://`` is merged from its records fetched into a local directory, then uploaded
(``data_pipeline.ingest.s3_merge``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from data_pipeline.ingest.ingest_state import IngestPlan, ShardRecord, finished_record, load_rows
from data_pipeline.shardset.manifest import SKIPPED_REPORT, ShardEntry, ShardManifest
from data_pipeline.shardset.table_file import TABLE_NAME, write_table
from trainer.temp_files import temp_sibling


class NoUsableImageError(ValueError):
    """Every listed image was skipped."""


class LocalRecords:
    """An ingest's plan and shard records where it writes them, in ``out_dir`` (``where`` in errors).
    ``s3_merge.S3Records`` is the same for a set on S3, fetched into a local directory."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.where = str(self.out_dir)

    def refresh(self) -> None:
        """Nothing to fetch: the files are read where they are."""

    def plan(self) -> IngestPlan:
        return IngestPlan.load(self.out_dir)

    def record(self, number: int) -> ShardRecord | None:
        return finished_record(self.out_dir, number)


def _missing(records, plan: IngestPlan) -> list[int]:
    return [number for number in range(plan.num_shards) if records.record(number) is None]


def _wait_for_plan(records, deadline: float, poll_seconds: float) -> IngestPlan:
    """The ingest's plan, waiting for it until ``deadline``: a merge Job starts with the parts, which
    write the plan only once they have listed the whole source (minutes at 14.2M files)."""
    while True:
        records.refresh()
        try:
            return records.plan()
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(min(poll_seconds, max(deadline - time.monotonic(), 0.0)))


def merge_shards(out_dir: Path | str, wait_seconds: float = 0.0, poll_seconds: float = 10.0) -> ShardManifest:
    """Merge a finished ingest in a directory; with ``wait_seconds``, wait that long for the parts to
    finish (``data_pipeline.ingest.merge_any`` also merges an ``s3://`` set)."""
    return merge_records(LocalRecords(Path(out_dir)), wait_seconds, poll_seconds)


def merge_records(records, wait_seconds: float = 0.0, poll_seconds: float = 10.0) -> ShardManifest:
    """Merge the ingest ``records`` (``LocalRecords`` or alike) into ``records.out_dir``."""
    out_dir, where = records.out_dir, records.where
    deadline = time.monotonic() + wait_seconds
    plan = _wait_for_plan(records, deadline, poll_seconds)
    missing = _missing(records, plan)
    while missing and time.monotonic() < deadline:
        time.sleep(min(poll_seconds, max(deadline - time.monotonic(), 0.0)))
        records.refresh()
        missing = _missing(records, plan)
    if missing:
        shown = ", ".join(str(number) for number in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ValueError(f"{where}: {len(missing)} of {plan.num_shards} shards are not written yet ({shown}); run "
                         "the make-shards parts that write them (shard n belongs to part n mod K of --part I/K), "
                         "then merge again")
    entries, tables, skipped = [], [], []
    first_id = 0
    for number in range(plan.num_shards):
        record = records.record(number)
        skipped += record.skipped
        if record.count == 0:
            continue
        rows = load_rows(out_dir, record)
        rows["shard"] = len(entries)
        tables.append(rows)
        entries.append(ShardEntry(record.tar, record.index, record.count, first_id, record.sha256))
        first_id += record.count
    if first_id == 0:
        raise NoUsableImageError(f"no usable image in {plan.source} ({len(skipped)} skipped, listed in "
                                 f"{where}/{SKIPPED_REPORT})")
    report = out_dir / SKIPPED_REPORT
    tmp = temp_sibling(report)
    tmp.write_text("".join(json.dumps(problem) + "\n" for problem in skipped))
    os.replace(tmp, report)
    table_sha256 = write_table(out_dir / TABLE_NAME, np.concatenate(tables))
    manifest = ShardManifest(num_instances=first_id, shards=entries, source=plan.source, class_names=plan.class_names,
                             table=TABLE_NAME, table_sha256=table_sha256, num_skipped=len(skipped),
                             skipped_report=SKIPPED_REPORT, listing_sha256=plan.listing_sha256)
    manifest.save(out_dir)
    return manifest
