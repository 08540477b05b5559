"""A shard set's manifest and sample table, wherever the set lives (``data_pipeline.storage``).

For ``s3://`` sets the sample table (284 MB at ImageNet-21K) is downloaded once per node into the
table cache (``data.storage.table_cache_dir``), checked against the manifest's ``table_sha256``
and memory-mapped from there, like a local set's: the ranks of a node wait on one file lock while
the first of them downloads it, and the file is named by its digest, so a later run, or another set
with the same table, reuses it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
from pathlib import Path

from data_pipeline.shardset.manifest import MANIFEST_NAME, ShardManifest
from data_pipeline.shardset.table_file import sha256_of
from data_pipeline.storage.shard_url import S3Url, ShardLocation, shard_location
from data_pipeline.storage.storage_errors import BucketNotFoundError
from data_pipeline.storage.storage_settings import storage_settings
from data_pipeline.storage.stores import open_store


def manifest_bytes(location: ShardLocation | str) -> bytes:
    """The manifest's bytes; ``FileNotFoundError`` naming the set and the command that makes it."""
    location = shard_location(location)
    store = open_store(location)
    try:
        return store.read_bytes(MANIFEST_NAME)
    except BucketNotFoundError:
        raise
    except FileNotFoundError as error:
        at = f" at {store.settings.describe_endpoint()}" if isinstance(location, S3Url) else ""
        raise FileNotFoundError(f"{store.describe(MANIFEST_NAME)} not found{at}; check the path, or create the shards "
                                f"with `instcls make-shards --out {location}` (an interrupted run leaves no manifest: "
                                "run it again, it resumes)") from error


def load_manifest(location: ShardLocation | str) -> ShardManifest:
    location = shard_location(location)
    if not isinstance(location, S3Url):
        return ShardManifest.load(location)
    return ShardManifest.parse(manifest_bytes(location).decode(), location.child(MANIFEST_NAME), str(location))


def manifest_sha256(location: ShardLocation | str) -> str:
    """``sha256:<hex>`` of the manifest's bytes: the same for a set copied byte for byte anywhere."""
    return f"sha256:{hashlib.sha256(manifest_bytes(location)).hexdigest()}"


def has_manifest(location: ShardLocation | str) -> bool:
    location = shard_location(location)
    if isinstance(location, S3Url):
        return open_store(location).exists(MANIFEST_NAME)
    return (Path(location) / MANIFEST_NAME).is_file()


def local_table(location: ShardLocation, manifest: ShardManifest, rebuild: str) -> Path:
    """The path of the set's sample table on this machine: in the set for a local one, in the
    node's table cache (downloaded and checked once) for an ``s3://`` one."""
    if not isinstance(location, S3Url):
        return Path(location) / manifest.table
    if not re.fullmatch(r"[0-9a-f]{64}", manifest.table_sha256 or ""):
        raise ValueError(f"{location.child(MANIFEST_NAME)} has no table_sha256 (64 hex digits) to check its table "
                         f"against; {rebuild}")
    cache = Path(storage_settings().resolved_table_cache)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{manifest.table_sha256}.npy"
    if path.is_file():
        return path
    with open(cache / f"{manifest.table_sha256}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank of this node may be downloading it
        if not path.is_file():
            partial = cache / f".{manifest.table_sha256}.{os.getpid()}.part"
            open_store(location).download(manifest.table, partial)
            digest = sha256_of(partial)
            if digest != manifest.table_sha256:
                partial.unlink()
                raise ValueError(f"{location.child(manifest.table)}: its SHA-256 is {digest}, the manifest says "
                                 f"{manifest.table_sha256} (the table was replaced, or the set copied partly); "
                                 f"{rebuild}")
            os.replace(partial, path)
    return path
