"""The sample table on disk: one binary row per instance id, memory-mapped by every process.

``samples.npy`` is a plain NumPy ``.npy`` file of ``ROW`` records (20 bytes each: the shard's
position in the manifest, the image's size and byte offset in that tar, the label).  Opening it
with ``np.load(mmap_mode="r")`` reads only its header, so a process opens 14.2M ids in
milliseconds instead of parsing every ``.idx`` line, and the pages it touches are the page
cache's: the ranks of a node share one copy.

The record layout is the format's version: a file with other fields is refused (naming the file
and the command that rebuilds it), as is one whose length or row count disagrees with the
manifest.  Its sha256 is in the manifest; ``validate-shards`` checks it (every open would read
the whole file, which is what the mapping avoids).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from trainer.temp_files import temp_sibling

TABLE_NAME = "samples.npy"
ROW = np.dtype([("shard", "<u4"), ("size", "<u4"), ("offset", "<u8"), ("label", "<i4")])
MAX_IMAGE_BYTES = 2**32 - 1


class TableError(ValueError):
    """The table file is missing, of another layout, or does not match its manifest."""


def empty_rows(count: int) -> np.ndarray:
    return np.zeros(count, dtype=ROW)


def write_table(path: Path, rows: np.ndarray) -> str:
    """Write ``rows`` (``ROW`` records) atomically; returns the file's sha256."""
    if rows.dtype != ROW:
        raise TypeError(f"sample table rows must be {ROW}, got {rows.dtype}")
    path = Path(path)
    tmp = temp_sibling(path)
    with open(tmp, "wb") as handle:
        np.save(handle, rows, allow_pickle=False)
        handle.flush()
        os.fsync(handle.fileno())
    digest = sha256_of(tmp)
    os.replace(tmp, path)
    return digest


def sha256_of(path: Path) -> str:
    with open(path, "rb") as handle:
        return sha256_of_stream(handle)


def sha256_of_stream(handle) -> str:
    """The hex sha256 of a binary file object from its current position to its end, read in blocks."""
    digest = hashlib.sha256()
    for block in iter(lambda: handle.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def open_table(path: Path, num_rows: int, rebuild: str) -> np.ndarray:
    """The read-only mapping of ``path``, checked against the manifest's ``num_rows``.
    ``rebuild``: the command that writes the table again, for the error messages."""
    path = Path(path)
    try:
        rows = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError as error:
        raise TableError(f"{path}: the sample table is missing; {rebuild}") from error
    except (ValueError, OSError) as error:  # not an .npy, truncated header, or shorter than its header says
        raise TableError(f"{path}: not a readable sample table ({error}); {rebuild}") from error
    if rows.dtype != ROW or rows.ndim != 1:
        raise TableError(f"{path}: rows are {rows.dtype} x {rows.shape}, this version reads {ROW} (a table of "
                         f"another version); {rebuild}")
    if rows.shape[0] != num_rows:
        raise TableError(f"{path}: {rows.shape[0]} rows, the manifest says {num_rows} instances; {rebuild}")
    expected_bytes = rows.offset + rows.nbytes
    actual_bytes = path.stat().st_size
    if actual_bytes != expected_bytes:
        raise TableError(f"{path}: {actual_bytes} bytes, a table of {num_rows} rows has {expected_bytes}; {rebuild}")
    return rows
