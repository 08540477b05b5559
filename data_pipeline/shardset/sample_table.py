"""Random access into a shard set: instance id -> (tar file, byte offset, size) of its image, and its label.

Samplers name samples by id, so loaders must read any sample without streaming its shard: a
byte-range read of the set's store (``data_pipeline.storage``: a local directory with one open
handle per shard, or ranged GETs under ``s3://bucket/prefix``).  Row i
of the shard set's sample table (``data_pipeline.shardset.table_file``, written by make-shards) is id i:
it is memory-mapped, so opening 14.2M ids costs a header read, every rank of a node shares the
pages, and a lookup touches one 4 KiB page.  Format-1 sets (no table yet) get theirs built in
memory from the ``.idx`` files (``data_pipeline.shardset.legacy_table``), with a warning naming the command
that writes it once; on S3 they are refused (upgrade them on disk first).
"""

from __future__ import annotations

import functools
import time
import warnings
from pathlib import Path

import numpy as np

from data_pipeline.shardset.legacy_table import RECREATE, rows_from_index_files
from data_pipeline.shardset.manifest import MANIFEST_NAME, ShardEntry
from data_pipeline.shardset.sample_ids import ID_BYTES, decode_int64
from data_pipeline.shardset.set_files import load_manifest, local_table
from data_pipeline.shardset.table_file import open_table
from data_pipeline.shardset.tar_index import parse_dali_index
from data_pipeline.storage.shard_url import S3Url, ShardLocation, shard_location
from data_pipeline.storage.storage_errors import BucketNotFoundError
from data_pipeline.storage.storage_settings import storage_settings
from data_pipeline.storage.stores import open_store


class ShardReadError(OSError):
    """A sample's bytes cannot be read as the index says (truncated or replaced tar file)."""


class LegacyShardSetWarning(UserWarning):
    """A shard set without a sample table: every process parses its index files."""


class SampleTable:
    """Where each instance's image lies, and its label; reads images by id from the set's store."""

    def __init__(self, shard_dir: ShardLocation | str) -> None:
        self.shard_dir = shard_location(shard_dir)
        self.store = open_store(self.shard_dir)
        manifest = load_manifest(self.shard_dir)
        if not isinstance(self.shard_dir, S3Url):  # a set rewritten in place: new tars, never read through old handles
            self.store.renew((Path(self.shard_dir) / MANIFEST_NAME).stat().st_mtime_ns)
        self.num_samples = manifest.num_instances
        self.shards = sorted(manifest.shards, key=lambda entry: entry.first_id) if manifest.legacy else manifest.shards
        first_ids = np.array([entry.first_id for entry in self.shards], dtype=np.int64)
        ends = first_ids + np.array([entry.count for entry in self.shards], dtype=np.int64)
        contiguous = len(self.shards) > 0 and first_ids[0] == 0 and np.array_equal(first_ids[1:], ends[:-1])
        if not contiguous or ends[-1] != self.num_samples:
            raise ValueError(f"{self.shard_dir}/manifest.json: shards do not hold ids 0..{self.num_samples - 1} "
                             f"contiguously in their order; {RECREATE}")
        self._label_offsets = None  # format 1: labels are read from the tars
        if manifest.legacy and isinstance(self.shard_dir, S3Url):
            raise ValueError(f"{self.shard_dir} was written by an older make-shards and has no sample table: run "
                             "`instcls upgrade-shards DIR` on a local copy and copy the set back")
        if manifest.legacy:
            started = time.perf_counter()
            self.rows, self._label_offsets = rows_from_index_files(self.shard_dir, manifest)
            warnings.warn(f"{self.shard_dir} was written by an older make-shards and has no sample table: this "
                          f"process parsed its {self.num_samples} index entries in "
                          f"{time.perf_counter() - started:.2f} s. Run `instcls upgrade-shards {self.shard_dir}` "
                          "once; every process then maps the table in milliseconds", LegacyShardSetWarning,
                          stacklevel=2)
        else:
            rebuild = f"rebuild it with `instcls merge-shards {self.shard_dir}`, or {RECREATE}"
            self.rows = open_table(local_table(self.shard_dir, manifest, rebuild), self.num_samples, rebuild)
            # A table of another shard set of the same size would pass the checks above: the first
            # and last rows must lie in the first and last shards.
            if self.rows[0]["shard"] != 0 or self.rows[-1]["shard"] != len(self.shards) - 1:
                raise ValueError(f"{self.store.describe(manifest.table)}: its rows do not match the manifest's shards; "
                                 f"{rebuild}")
        self.store.make_room(len(self.shards))

    def shard_of(self, sample_id: int) -> ShardEntry:
        return self.shards[int(self.rows[sample_id]["shard"])]

    def describe(self, sample_id: int) -> str:
        """``"<tar> key <key>"``: how error messages name a sample."""
        return f"{self.shard_of(sample_id).tar} key {self._key(sample_id)}"

    def open_all(self) -> None:
        """Open every shard's handle now (a local set), so that forked loader workers inherit them."""
        self.store.open_all([entry.tar for entry in self.shards])

    def _key(self, sample_id: int) -> str:
        """The key of the sample's image in its tar (read from the index file: only errors need it)."""
        entry, offset = self.shard_of(sample_id), int(self.rows[sample_id]["offset"])
        try:
            keys = _keys_by_offset(self.store, entry.index)
        except (OSError, ValueError):
            return f"? (image at byte {offset})"
        return keys.get(offset, f"? (image at byte {offset})")

    def _read(self, sample_id: int, offset: int, size: int, component: str) -> bytes:
        tar = self.shard_of(sample_id).tar
        try:
            data = self.store.read_range(tar, offset, size)
        except BucketNotFoundError:
            raise  # the URL or endpoint is wrong, not the shard
        except (FileNotFoundError, PermissionError, IsADirectoryError) as error:
            raise ShardReadError(f"{self.describe(sample_id)}: cannot open {self.store.describe(tar)} ({error}); "
                                 f"{RECREATE}") from error
        if len(data) != size:
            raise ShardReadError(f"{self.describe(sample_id)}: .{component} needs {size} bytes at offset {offset}, "
                                 f"{self.store.describe(tar)} has {len(data)} there (truncated or rewritten tar); "
                                 f"{RECREATE}")
        return data

    def read_jpeg(self, sample_id: int) -> bytes:
        row = self.rows[sample_id]
        return self._read(sample_id, int(row["offset"]), int(row["size"]), "jpg")

    def labels(self, ids: np.ndarray) -> np.ndarray:
        """The labels of ``ids`` (-1: none): the table's column, or, for a shard set an older
        make-shards wrote, read from the tars one by one."""
        if self._label_offsets is not None:
            return np.array([self.read_label(int(i)) for i in ids], dtype=np.int64)
        return np.asarray(self.rows["label"][ids], dtype=np.int64)

    def read_label(self, sample_id: int) -> int:
        if self._label_offsets is not None:
            return decode_int64(self._read(sample_id, int(self._label_offsets[sample_id]), ID_BYTES, "cls"))
        return int(self.rows[sample_id]["label"])


@functools.lru_cache(maxsize=8)
def _keys_by_offset(store, index: str) -> dict[int, str]:
    return {component.offset: sample.key
            for sample in parse_dali_index(store.read_bytes(index).decode(), store.describe(index))
            for component in sample.components}


@functools.lru_cache(maxsize=4)
def _cached_table(shard_dir: ShardLocation, version: object) -> SampleTable:
    return SampleTable(shard_dir)


def forget_tables() -> None:
    """Open every shard set afresh on next use (a process that changed its storage settings; the bench)."""
    _cached_table.cache_clear()


def sample_table(shard_dir: ShardLocation | str) -> SampleTable:
    """The table of ``shard_dir``, opened once per process (a train and an eval loader share it);
    a local set whose manifest was rewritten (new mtime) is opened again, and an ``s3://`` one under
    other storage settings."""
    location = shard_location(shard_dir)
    if isinstance(location, S3Url):
        return _cached_table(location, storage_settings())
    manifest_path = Path(location).resolve() / MANIFEST_NAME
    mtime = manifest_path.stat().st_mtime_ns if manifest_path.exists() else 0
    return _cached_table(manifest_path.parent, mtime)
