"""Shard sets written before the sample table (manifest format ``instcls-shards/1``).

Their keys are the instance ids, their ``.idx`` files say where every component lies, and the
labels are in the tars' ``.cls`` components.  ``rows_from_index_files`` builds the table from
those (about 3 us per sample: a loader does it in memory, once per process, and says so);
``upgrade_shard_set`` writes it next to the manifest once and makes the manifest format 2, after
which every process maps it.  The tars are not touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from data_pipeline.manifest import FORMAT, ShardEntry, ShardManifest
from data_pipeline.shard_merge import SKIPPED_REPORT
from data_pipeline.shard_writer import ID_BYTES, decode_int64
from data_pipeline.table_file import ROW, TABLE_NAME, write_table
from data_pipeline.tar_index import read_dali_index

RECREATE = "recreate the shard set with `instcls make-shards`, or check it with `instcls validate-shards`"


def legacy_shard_rows(shard_dir: Path, entry: ShardEntry) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, rows)`` of one shard, from its index file and its ``.cls`` components."""
    index_path = Path(shard_dir) / entry.index
    samples = read_dali_index(index_path)
    if len(samples) != entry.count:
        raise ValueError(f"{index_path}: lists {len(samples)} samples, the manifest says {entry.count} for "
                         f"{entry.tar}; {RECREATE}")
    ids = np.empty(len(samples), dtype=np.int64)
    rows = np.zeros(len(samples), dtype=ROW)
    with open(Path(shard_dir) / entry.tar, "rb") as tar:
        for at, sample in enumerate(samples):
            jpeg, label = sample.find("jpg"), sample.find("cls")
            if jpeg is None or label is None:
                raise ValueError(f"{index_path}: sample {sample.key} has no .jpg or no .cls component; {RECREATE}")
            if not sample.key.isdigit():
                raise ValueError(f"{index_path}: key {sample.key!r} is not an instance id; {RECREATE}")
            ids[at] = int(sample.key)
            tar.seek(label.offset)
            rows[at] = (0, jpeg.size, jpeg.offset, decode_int64(tar.read(ID_BYTES)))
    expected = np.arange(entry.first_id, entry.first_id + entry.count)
    if not np.array_equal(np.sort(ids), expected):
        raise ValueError(f"{index_path}: keys are not exactly the ids [{entry.first_id}, {entry.first_id + entry.count})"
                         f" that the manifest gives {entry.tar}; {RECREATE}")
    return ids, rows


def rows_from_index_files(shard_dir: Path, manifest: ShardManifest) -> np.ndarray:
    """The sample table of a format-1 shard set, in memory."""
    table = np.zeros(manifest.num_instances, dtype=ROW)
    for position, entry in enumerate(manifest.shards):
        ids, rows = legacy_shard_rows(shard_dir, entry)
        rows["shard"] = position
        table[ids] = rows
    return table


def upgrade_shard_set(shard_dir: Path) -> ShardManifest:
    """Write the sample table of a format-1 set and make its manifest format 2 (its skipped list
    moves to the report file).  A format-2 set is left as it is."""
    shard_dir = Path(shard_dir)
    manifest = ShardManifest.load(shard_dir)
    if not manifest.legacy:
        return manifest
    entries = sorted(manifest.shards, key=lambda entry: entry.first_id)
    manifest.shards = entries
    table_sha256 = write_table(shard_dir / TABLE_NAME, rows_from_index_files(shard_dir, manifest))
    report = shard_dir / SKIPPED_REPORT
    tmp = report.with_name(f"{report.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(problem) + "\n" for problem in manifest.skipped))
    os.replace(tmp, report)
    upgraded = ShardManifest(num_instances=manifest.num_instances, shards=entries, source=manifest.source,
                             class_names=manifest.class_names, format=FORMAT, table=TABLE_NAME,
                             table_sha256=table_sha256, num_skipped=len(manifest.skipped),
                             skipped_report=SKIPPED_REPORT)
    upgraded.save(shard_dir)
    return upgraded
