"""The merge step: every shard's record -> the sample table, the skipped-images report, the manifest.

Ids are numbered here, 0..N-1 in shard order and, within a shard, in stored order, so they are
the same however many parts or workers wrote the shards.  Only the records are read (14k small
files for ImageNet-21K), never the tars.  The manifest is written last: a shard set without one
is unfinished, and the merge can run again at any time (``instcls merge-shards``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from data_pipeline.ingest.ingest_state import IngestPlan, finished_record, load_rows
from data_pipeline.shardset.manifest import SKIPPED_REPORT, ShardEntry, ShardManifest
from data_pipeline.shardset.table_file import TABLE_NAME, write_table


class NoUsableImageError(ValueError):
    """Every listed image was skipped."""


def _missing(out_dir: Path, plan: IngestPlan) -> list[int]:
    return [number for number in range(plan.num_shards) if finished_record(out_dir, number) is None]


def _wait_for_plan(out_dir: Path, deadline: float, poll_seconds: float) -> IngestPlan:
    """The ingest's plan, waiting for it until ``deadline``: a merge Job starts with the parts, which
    write the plan only once they have listed the whole source (minutes at 14.2M files)."""
    while True:
        try:
            return IngestPlan.load(out_dir)
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(min(poll_seconds, max(deadline - time.monotonic(), 0.0)))


def merge_shards(out_dir: Path, wait_seconds: float = 0.0, poll_seconds: float = 10.0) -> ShardManifest:
    """Merge a finished ingest; with ``wait_seconds``, wait that long for the parts to finish."""
    out_dir = Path(out_dir)
    deadline = time.monotonic() + wait_seconds
    plan = _wait_for_plan(out_dir, deadline, poll_seconds)
    missing = _missing(out_dir, plan)
    while missing and time.monotonic() < deadline:
        time.sleep(min(poll_seconds, max(deadline - time.monotonic(), 0.0)))
        missing = _missing(out_dir, plan)
    if missing:
        shown = ", ".join(str(number) for number in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ValueError(f"{out_dir}: {len(missing)} of {plan.num_shards} shards are not written yet ({shown}); run "
                         "the make-shards parts that write them (shard n belongs to part n mod K of --part I/K), "
                         "then merge again")
    entries, tables, skipped = [], [], []
    first_id = 0
    for number in range(plan.num_shards):
        record = finished_record(out_dir, number)
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
                                 f"{out_dir / SKIPPED_REPORT})")
    report = out_dir / SKIPPED_REPORT
    tmp = report.with_name(f"{report.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(problem) + "\n" for problem in skipped))
    os.replace(tmp, report)
    table_sha256 = write_table(out_dir / TABLE_NAME, np.concatenate(tables))
    manifest = ShardManifest(num_instances=first_id, shards=entries, source=plan.source, class_names=plan.class_names,
                             table=TABLE_NAME, table_sha256=table_sha256, num_skipped=len(skipped),
                             skipped_report=SKIPPED_REPORT, listing_sha256=plan.listing_sha256)
    manifest.save(out_dir)
    return manifest
