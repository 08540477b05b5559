"""`instcls make-shards`: images -> WebDataset tar shards + DALI index files + manifest.

Each sample is ``<key>.jpg`` (the image, JPEG), ``<key>.id`` (its dense instance id as 8 bytes of
little-endian int64, which DALI's reader emits as a fixed-width INT64 tensor) and ``<key>.cls``
(its semantic label the same way, -1 when unknown); the key is the zero-padded id.

Every image is fully decoded before it is written: a DALI pipeline dies on one corrupt JPEG, so
bad data is refused (naming the file) or skipped and counted, never shipped.  Shards are written
to a temporary name and renamed when complete; the manifest comes last.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image
from tqdm import tqdm
from wds2idx import IndexCreator

from data_pipeline.manifest import MANIFEST_NAME, ShardEntry, ShardManifest
from data_pipeline.sources import Source, SourceImage

JPEG_QUALITY = 95
ID_BYTES = 8


class BadImageError(ValueError):
    """An input image cannot be decoded."""


@dataclass(frozen=True)
class ShardSettings:
    prefix: str = "shard"
    samples_per_shard: int = 1000
    on_bad_image: str = "error"  # or "skip"
    seed: int = 0
    workers: int = 2
    max_side: int | None = None  # shrink larger images so their longer side is this (None: keep)

    def __post_init__(self) -> None:
        if self.samples_per_shard < 1:
            raise ValueError(f"--samples-per-shard {self.samples_per_shard}: use at least 1")
        if self.on_bad_image not in ("error", "skip"):
            raise ValueError(f"--on-bad-image {self.on_bad_image!r}: choose 'error' or 'skip'")
        if "/" in self.prefix or not self.prefix:
            raise ValueError(f"--prefix {self.prefix!r}: use a plain file-name prefix such as 'imagenet-train'")


def encode_int64(value: int) -> bytes:
    return np.int64(value).tobytes()  # little-endian on every platform we run on


def decode_int64(raw: bytes) -> int:
    if len(raw) != ID_BYTES:
        raise ValueError(f"expected {ID_BYTES} bytes, got {len(raw)}")
    return int(np.frombuffer(raw, dtype="<i8")[0])


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


def _check_task(job: tuple[SourceImage, int | None]) -> tuple[bytes | None, str | None]:
    return checked_jpeg(*job)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _ShardSink:
    """Writes samples into consecutive tar files, finishing each one (rename, index, checksum)."""

    def __init__(self, out_dir: Path, settings: ShardSettings) -> None:
        self.out_dir = out_dir
        self.settings = settings
        self.entries: list[ShardEntry] = []
        self._writer: wds.TarWriter | None = None
        self._count = 0
        self._first_id = 0

    def _tar_name(self) -> str:
        return f"{self.settings.prefix}-{len(self.entries):06d}.tar"

    def add(self, instance_id: int, label: int, jpeg: bytes) -> None:
        if self._writer is None:
            self._tmp_path = self.out_dir / (self._tar_name() + ".tmp")
            self._writer = wds.TarWriter(str(self._tmp_path))
            self._count, self._first_id = 0, instance_id
        self._writer.write(
            {"__key__": f"{instance_id:010d}", "jpg": jpeg, "id": encode_int64(instance_id), "cls": encode_int64(label)}
        )
        self._count += 1
        if self._count == self.settings.samples_per_shard:
            self.finish_shard()

    def finish_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        tar_name = self._tar_name()
        tar_path = self.out_dir / tar_name
        os.replace(self._tmp_path, tar_path)
        index_name = tar_name[: -len(".tar")] + ".idx"
        index_tmp = self.out_dir / (index_name + ".tmp")
        with IndexCreator(str(tar_path), str(index_tmp), verbose=False) as creator:
            creator.create_index()
        os.replace(index_tmp, self.out_dir / index_name)
        self.entries.append(ShardEntry(tar_name, index_name, self._count, self._first_id, sha256_of(tar_path)))

    def abandon(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._tmp_path.unlink(missing_ok=True)
            self._writer = None


def write_shards(source: Source, out_dir: Path, settings: ShardSettings, progress: bool = True) -> ShardManifest:
    """Shuffle ``source`` with the seed, check every image, write the shards and the manifest."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / MANIFEST_NAME).exists():
        raise FileExistsError(f"{out_dir / MANIFEST_NAME} exists; write to an empty directory or delete the old shard set")
    # Stored order = training read order within a shard: shuffle so shards are not class-sorted.
    order = np.random.default_rng(settings.seed).permutation(len(source.images))
    images = [source.images[i] for i in order]
    sink = _ShardSink(out_dir, settings)
    skipped: list[dict] = []
    next_id = 0
    try:
        with Pool(settings.workers) as pool:
            checked = pool.imap(_check_task, ((image, settings.max_side) for image in images), chunksize=16)
            bar = tqdm(zip(images, checked), total=len(images), desc="make-shards", disable=not progress, unit="img")
            for image, (jpeg, problem) in bar:
                if problem is not None:
                    if settings.on_bad_image == "error":
                        raise BadImageError(
                            f"{image.origin} {problem}; fix or remove the file, or rerun with --on-bad-image skip"
                        )
                    skipped.append({"origin": image.origin, "reason": problem})
                    continue
                sink.add(next_id, image.label, jpeg)
                next_id += 1
        sink.finish_shard()
    except BaseException:
        sink.abandon()
        raise
    if next_id == 0:
        raise BadImageError(f"no usable image in {source.name} ({len(skipped)} skipped)")
    manifest = ShardManifest(
        num_instances=next_id, shards=sink.entries, source=source.name, class_names=source.class_names, skipped=skipped
    )
    manifest.save(out_dir)
    return manifest
