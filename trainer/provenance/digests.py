"""Digests that identify a run's inputs: the training data (its manifest, which holds every shard's
SHA-256) and a weights file a run started from."""

from __future__ import annotations

import hashlib
from pathlib import Path

from data_pipeline.contract import load_manifest, manifest_sha256

_BLOCK = 8 << 20


def file_sha256(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes, read in blocks (weights files are gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(_BLOCK):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def manifest_digest(shards) -> dict[str, object]:
    """``{path, digest, images}`` of a shard set: the digest of its ``manifest.json`` (which lists
    every shard's SHA-256 and the sample table's, so equal digests mean the same data in the same
    order of ids) and its number of images."""
    return {"path": str(shards), "digest": manifest_sha256(shards), "images": load_manifest(shards).num_instances}
