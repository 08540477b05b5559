"""One shard from its images: the job a make-shards worker process runs.

A sample is ``<key>.cls`` (its semantic label as 8 bytes of little-endian int64, -1 when unknown,
the fixed-width value DALI reads) and ``<key>.jpg``; the key is the sample's position in the
seeded order of the listing, zero-padded (its instance id when no image was skipped: ids are
assigned when the shards are merged, ``data_pipeline.ingest.shard_merge``).

Every image is fully decoded before it is written: a DALI pipeline dies on one corrupt JPEG, so
bad data is refused (naming the file) or skipped and listed, never shipped.  The tar is written
under a temporary name with fixed member times, so the same images give byte-identical shards
whichever process writes them; the shard's record (``data_pipeline.ingest.ingest_state``) comes last
and marks it done.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import webdataset as wds
from PIL import Image

from data_pipeline.ingest.ingest_state import ShardRecord, save_record
from data_pipeline.ingest.sources.generated import SourceImage
from data_pipeline.shardset.sample_ids import encode_int64
from data_pipeline.shardset.table_file import MAX_IMAGE_BYTES, empty_rows, sha256_of
from data_pipeline.shardset.tar_index import scan_tar, write_dali_index
from trainer.temp_files import temp_sibling

JPEG_QUALITY = 95
TAR_MTIME = 0  # member times fixed: a shard's bytes depend on its images only
KEY_DIGITS = 10


class BadImageError(ValueError):
    """An input image cannot be decoded."""


def checked_jpeg(image: SourceImage, max_side: int | None) -> tuple[bytes | None, str | None]:
    """``(jpeg_bytes, None)`` for a usable image, ``(None, reason)`` otherwise.

    Baseline RGB/grayscale JPEGs that need no resizing keep their original bytes; anything else
    (PNG, CMYK, palette, oversized) is converted to an RGB JPEG.
    """
    try:
        raw = image.read()
    except OSError as error:
        return None, f"cannot be read ({error})"
    try:
        with Image.open(io.BytesIO(raw)) as decoded:
            decoded.load()  # a full decode: truncated or corrupt data fails here
            too_big = max_side is not None and max(decoded.size) > max_side
            if decoded.format == "JPEG" and decoded.mode in ("RGB", "L") and not too_big:
                return raw, None
            rgb = decoded.convert("RGB")
            if too_big:
                rgb.thumbnail((max_side, max_side), Image.BICUBIC)
            out = io.BytesIO()
            rgb.save(out, format="JPEG", quality=JPEG_QUALITY)
            return out.getvalue(), None
    except Exception as error:  # PIL raises many types for bad data
        return None, f"does not decode as an image ({type(error).__name__}: {error})"


def shard_name(prefix: str, number: int) -> str:
    return f"{prefix}-{number:06d}"


@dataclass(frozen=True)
class ShardJob:
    """Shard ``number``: ``images`` are the listing's positions ``first_position ...`` in the
    seeded order."""

    out_dir: str
    prefix: str
    number: int
    first_position: int
    images: list[SourceImage]
    max_side: int | None
    on_bad_image: str


def write_shard(job: ShardJob) -> int:
    """Write the shard, its DALI index and its record; returns how many images it holds."""
    out_dir, name = Path(job.out_dir), shard_name(job.prefix, job.number)
    tar_path, index_path = out_dir / f"{name}.tar", out_dir / f"{name}.idx"
    tmp = temp_sibling(tar_path)
    labels, skipped = [], []
    try:
        with wds.TarWriter(str(tmp), mtime=TAR_MTIME) as writer:
            for position, image in enumerate(job.images, start=job.first_position):
                jpeg, problem = checked_jpeg(image, job.max_side)
                if problem is None and len(jpeg) > MAX_IMAGE_BYTES:
                    problem = f"is {len(jpeg)} bytes, more than the {MAX_IMAGE_BYTES} a sample table row holds"
                if problem is not None:
                    if job.on_bad_image == "error":
                        raise BadImageError(f"{image.origin} {problem}; fix or replace the file and run again (the "
                                            "finished shards are kept), or rerun with --on-bad-image skip")
                    skipped.append({"origin": image.origin, "reason": problem})
                    continue
                writer.write({"__key__": f"{position:0{KEY_DIGITS}d}", "jpg": jpeg, "cls": encode_int64(image.label)})
                labels.append(image.label)
        rows = empty_rows(len(labels))
        if labels:
            samples = scan_tar(tmp)
            write_dali_index(samples, tar_path, index_path)
            jpegs = [sample.find("jpg") for sample in samples]
            rows["offset"] = [c.offset for c in jpegs]
            rows["size"] = [c.size for c in jpegs]
            rows["label"] = labels
            os.replace(tmp, tar_path)
        else:  # every image was skipped: no empty tar (DALI refuses one), the record says so
            tmp.unlink()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    record = ShardRecord(number=job.number, tar=tar_path.name if labels else None,
                         index=index_path.name if labels else None, count=len(labels),
                         sha256=sha256_of(tar_path) if labels else None,
                         tar_bytes=tar_path.stat().st_size if labels else 0, skipped=skipped)
    save_record(out_dir, record, rows)
    return len(labels)
