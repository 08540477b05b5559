"""Shard sets written before the sample table (manifest format ``instcls-shards/1``).

Their keys are the instance ids, their ``.idx`` files say where every component lies, and the
labels are in the tars' ``.cls`` components.  ``rows_from_index_files`` builds the table from
the index files (a few us per sample: a loader does it in memory, once per process, and says so;
labels are read from the tars when asked, as before);
``upgrade_shard_set`` writes it next to the manifest once and makes the manifest format 2, after
which every process maps it.  The tars are not touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from data_pipeline.shardset.manifest import FORMAT, SKIPPED_REPORT, ShardEntry, ShardManifest
from data_pipeline.shardset.sample_ids import ID_BYTES, decode_int64
from data_pipeline.shardset.table_file import ROW, TABLE_NAME, write_table
from data_pipeline.shardset.tar_index import FIELDS_PER_COMPONENT, INDEX_VERSION
from trainer.temp_files import temp_sibling

RECREATE = "recreate the shard set with `instcls make-shards`, or check it with `instcls validate-shards`"


def _component_column(rows: np.ndarray, extension: str, index_path: Path) -> np.ndarray:
    """Per sample, the first field of its ``extension`` group; every sample must have one."""
    extensions = rows[:, 0::FIELDS_PER_COMPONENT]
    matches = extensions == extension
    missing = np.flatnonzero(matches.sum(axis=1) != 1)
    if missing.size:
        raise ValueError(f"{index_path}: sample line {missing[0] + 2} has no single .{extension} component; {RECREATE}")
    return matches.argmax(axis=1) * FIELDS_PER_COMPONENT


def parse_index(index_path: Path, entry: ShardEntry) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, jpeg offsets, jpeg sizes, label offsets)`` of one shard's index file, in stored order
    (vectorised: every sample of a format-1 shard has the same components)."""
    tokens = index_path.read_text().split()
    if tokens[:2] != [INDEX_VERSION, str(entry.count)]:
        raise ValueError(f"{index_path}: header {' '.join(tokens[:2])!r} is not '{INDEX_VERSION} {entry.count}' "
                         f"(the manifest's count for {entry.tar}); {RECREATE}")
    body = np.array(tokens[2:])
    if body.size % entry.count:
        raise ValueError(f"{index_path}: samples list different numbers of components; {RECREATE}")
    rows = body.reshape(entry.count, -1)
    every_sample = np.arange(entry.count)
    jpeg, label = (_component_column(rows, ext, index_path) for ext in ("jpg", "cls"))
    keys = np.char.partition(rows[every_sample, jpeg + 3], ".")[:, 0]
    try:
        ids = keys.astype(np.int64)
    except ValueError as error:
        raise ValueError(f"{index_path}: a key is not an instance id ({error}); {RECREATE}") from error
    expected = np.arange(entry.first_id, entry.first_id + entry.count)
    if not np.array_equal(np.sort(ids), expected):
        raise ValueError(f"{index_path}: keys are not exactly the ids [{entry.first_id}, "
                         f"{entry.first_id + entry.count}) that the manifest gives {entry.tar}; {RECREATE}")
    as_int = lambda column: rows[every_sample, column].astype(np.int64)  # noqa: E731
    return ids, as_int(jpeg + 1), as_int(jpeg + 2), as_int(label + 1)


def read_labels(tar_path: Path, offsets: np.ndarray) -> np.ndarray:
    """The int64 ``.cls`` values at ``offsets`` of one tar."""
    labels = np.empty(len(offsets), dtype=np.int64)
    with open(tar_path, "rb") as tar:
        for at, offset in enumerate(offsets.tolist()):
            tar.seek(offset)
            labels[at] = decode_int64(tar.read(ID_BYTES))
    return labels


def legacy_shard_rows(shard_dir: Path, entry: ShardEntry) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, rows)`` of one shard, labels read from its tar."""
    ids, offsets, sizes, label_offsets = parse_index(Path(shard_dir) / entry.index, entry)
    rows = np.zeros(len(ids), dtype=ROW)
    rows["offset"], rows["size"] = offsets, sizes
    rows["label"] = read_labels(Path(shard_dir) / entry.tar, label_offsets)
    return ids, rows


def rows_from_index_files(shard_dir: Path, manifest: ShardManifest) -> tuple[np.ndarray, np.ndarray]:
    """``(table rows, label offsets)`` of a format-1 shard set, in memory; the labels stay in the
    tars (``label`` is 0 here) and are read when asked, as before the table existed."""
    table = np.zeros(manifest.num_instances, dtype=ROW)
    label_offsets = np.zeros(manifest.num_instances, dtype=np.int64)
    for position, entry in enumerate(manifest.shards):
        ids, offsets, sizes, labels_at = parse_index(Path(shard_dir) / entry.index, entry)
        table["shard"][ids], table["offset"][ids], table["size"][ids] = position, offsets, sizes
        label_offsets[ids] = labels_at
    return table, label_offsets


def upgrade_shard_set(shard_dir: Path) -> ShardManifest:
    """Write the sample table of a format-1 set and make its manifest format 2 (its skipped list
    moves to the report file).  A format-2 set is left as it is."""
    shard_dir = Path(shard_dir)
    manifest = ShardManifest.load(shard_dir)
    if not manifest.legacy:
        return manifest
    entries = sorted(manifest.shards, key=lambda entry: entry.first_id)
    manifest.shards = entries
    rows, label_offsets = rows_from_index_files(shard_dir, manifest)
    for entry in entries:
        ids = slice(entry.first_id, entry.first_id + entry.count)
        rows["label"][ids] = read_labels(shard_dir / entry.tar, label_offsets[ids])
    table_sha256 = write_table(shard_dir / TABLE_NAME, rows)
    report = shard_dir / SKIPPED_REPORT
    tmp = temp_sibling(report)
    tmp.write_text("".join(json.dumps(problem) + "\n" for problem in manifest.skipped))
    os.replace(tmp, report)
    upgraded = ShardManifest(num_instances=manifest.num_instances, shards=entries, source=manifest.source,
                             class_names=manifest.class_names, format=FORMAT, table=TABLE_NAME,
                             table_sha256=table_sha256, num_skipped=len(manifest.skipped),
                             skipped_report=SKIPPED_REPORT)
    upgraded.save(shard_dir)
    return upgraded
