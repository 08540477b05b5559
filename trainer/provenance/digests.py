"""Digests that identify a run's inputs: the training data (its manifest, which holds every shard's
SHA-256) and a weights file a run started from."""

from __future__ import annotations

import hashlib
from pathlib import Path

from data_pipeline.contract import MANIFEST_NAME, ShardManifest

_BLOCK = 8 << 20


def file_sha256(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes, read in blocks (weights files are gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(_BLOCK):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def manifest_digest(shards: Path) -> dict[str, object]:
    """``{path, digest, images}`` of a shard set: the digest of its ``manifest.json`` (which lists
    every shard's SHA-256 and the sample table's, so equal digests mean the same data in the same
    order of ids) and its number of images."""
    manifest = ShardManifest.load(shards)
    return {"path": str(shards), "digest": file_sha256(Path(shards) / MANIFEST_NAME),
            "images": manifest.num_instances}
