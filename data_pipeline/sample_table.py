"""Random access into a shard set: instance id -> (tar file, byte offset, size) of its components.

Samplers name samples by id, so loaders must read any sample without streaming its shard.  The
DALI index files that make-shards writes next to every tar (``wds2idx`` format ``v1.2``: a header
``v1.2 <count>``, then one line per sample of ``<ext> <offset> <size> <file name>`` groups) already
hold every component's byte range.  They are parsed once per shard set and process (cached), into
three numbers per sample; the tar headers are never scanned.  Keys are the zero-padded ids
(``data_pipeline.shards``), and every shard must hold exactly the ids its manifest entry says.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from data_pipeline.manifest import MANIFEST_NAME, ShardEntry, ShardManifest
from data_pipeline.shards import ID_BYTES, decode_int64

INDEX_VERSION = "v1.2"
FIELDS_PER_COMPONENT = 4  # extension, offset, size, file name
RECREATE = "recreate the shard set with `instcls make-shards`, or check it with `instcls validate-shards`"


class ShardReadError(OSError):
    """A sample's bytes cannot be read as the index says (truncated or replaced tar file)."""


def _component_column(rows: np.ndarray, extension: str, index_path: Path) -> np.ndarray:
    """Per sample, the first field of its ``extension`` group; every sample must have one."""
    extensions = rows[:, 0::FIELDS_PER_COMPONENT]
    matches = extensions == extension
    missing = np.flatnonzero(matches.sum(axis=1) != 1)
    if missing.size:
        raise ValueError(f"{index_path}: sample line {missing[0] + 2} has no single .{extension} component; {RECREATE}")
    return matches.argmax(axis=1) * FIELDS_PER_COMPONENT


def parse_index(index_path: Path, entry: ShardEntry) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, jpeg offsets, jpeg sizes, label offsets)`` of one shard's index file, in stored order."""
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
    names = rows[every_sample, jpeg + 3]
    keys = np.char.partition(names, ".")[:, 0]
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


class SampleTable:
    """Where each instance's ``.jpg`` and ``.cls`` lie; reads them by id with ``os.pread``.

    Files are opened per read: a step touches up to ``batch`` different shards out of thousands,
    more than a process may keep open, and nothing open survives into forked workers.
    """

    def __init__(self, shard_dir: Path) -> None:
        self.shard_dir = Path(shard_dir)
        manifest = ShardManifest.load(self.shard_dir)
        self.num_samples = manifest.num_instances
        self.shards = sorted(manifest.shards, key=lambda entry: entry.first_id)
        self._first_ids = np.array([entry.first_id for entry in self.shards], dtype=np.int64)
        ends = self._first_ids + np.array([entry.count for entry in self.shards], dtype=np.int64)
        contiguous = self._first_ids[0] == 0 and np.array_equal(self._first_ids[1:], ends[:-1])
        if not contiguous or ends[-1] != self.num_samples:
            raise ValueError(f"{self.shard_dir}/manifest.json: shards do not hold ids 0..{self.num_samples - 1} "
                             f"contiguously; {RECREATE}")
        self.jpeg_offset = np.zeros(self.num_samples, dtype=np.int64)
        self.jpeg_size = np.zeros(self.num_samples, dtype=np.int64)
        self.label_offset = np.zeros(self.num_samples, dtype=np.int64)
        for entry in self.shards:
            ids, jpeg_offset, jpeg_size, label_offset = parse_index(self.shard_dir / entry.index, entry)
            self.jpeg_offset[ids], self.jpeg_size[ids], self.label_offset[ids] = jpeg_offset, jpeg_size, label_offset

    def shard_of(self, sample_id: int) -> ShardEntry:
        return self.shards[int(np.searchsorted(self._first_ids, sample_id, side="right")) - 1]

    def describe(self, sample_id: int) -> str:
        """``"<tar> key <key>"``: how error messages name a sample."""
        return f"{self.shard_of(sample_id).tar} key {sample_id:010d}"

    def _read(self, sample_id: int, offset: int, size: int, component: str) -> bytes:
        path = self.shard_dir / self.shard_of(sample_id).tar
        try:
            handle = os.open(path, os.O_RDONLY)
        except OSError as error:
            raise ShardReadError(f"{self.describe(sample_id)}: cannot open {path} ({error}); {RECREATE}") from error
        try:
            data = os.pread(handle, size, offset)
        finally:
            os.close(handle)
        if len(data) != size:
            raise ShardReadError(f"{self.describe(sample_id)}: .{component} needs {size} bytes at offset {offset}, the "
                                 f"file has {len(data)} there (truncated or rewritten tar); {RECREATE}")
        return data

    def read_jpeg(self, sample_id: int) -> bytes:
        return self._read(sample_id, int(self.jpeg_offset[sample_id]), int(self.jpeg_size[sample_id]), "jpg")

    def read_label(self, sample_id: int) -> int:
        return decode_int64(self._read(sample_id, int(self.label_offset[sample_id]), ID_BYTES, "cls"))


@functools.lru_cache(maxsize=4)
def _cached_table(shard_dir: str, manifest_mtime_ns: int) -> SampleTable:
    return SampleTable(Path(shard_dir))


def sample_table(shard_dir: Path) -> SampleTable:
    """The table of ``shard_dir``, parsed once per process (a train and an eval loader share it);
    a rewritten manifest (new mtime) is parsed again."""
    manifest_path = Path(shard_dir).resolve() / MANIFEST_NAME
    mtime = manifest_path.stat().st_mtime_ns if manifest_path.exists() else 0
    return _cached_table(str(manifest_path.parent), mtime)
