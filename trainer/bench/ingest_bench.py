"""`instcls bench ingest`: images per second, and per worker process, of make-shards on a folder of
photo-like JPEGs, with the same images three ways: kept as they are (read, full decode check, tar,
index, checksum), shrunk with ``--max-side`` (decode, resize, re-encode), and the resulting tars
indexed in place (decode check only, nothing written but the index).

The images are crops of the photographs that ship inside scikit-learn and matplotlib, at an
ImageNet-like size, so decoding costs what it does on photos (smooth synthetic images decode
faster).  With one worker per core, images/s per worker is the throughput per core.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.sources.files import image_folder
from data_pipeline.ingest.sources.scenes import photos
from data_pipeline.ingest.tars_in_place import index_tars
from trainer.bench.settings.ingest import IngestBenchSettings


def photo_folder(settings: IngestBenchSettings, root: Path) -> int:
    """Write the JPEGs; returns their total size in bytes."""
    rng = np.random.default_rng(0)
    library, total = photos(), 0
    root.mkdir(parents=True, exist_ok=True)
    for index in range(settings.images):
        photo = library[index % len(library)]
        image = Image.fromarray(photo)
        if photo.shape[0] < settings.height or photo.shape[1] < settings.width:
            image = image.resize((max(settings.width, photo.shape[1]), max(settings.height, photo.shape[0])))
        top = int(rng.integers(0, image.height - settings.height + 1))
        left = int(rng.integers(0, image.width - settings.width + 1))
        crop = image.crop((left, top, left + settings.width, top + settings.height))
        if index % 2:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        path = root / f"{index // 1000:04d}" / f"img-{index:07d}.jpg"
        path.parent.mkdir(exist_ok=True)
        crop.save(path, format="JPEG", quality=settings.quality)
        total += path.stat().st_size
    return total


def run(settings: IngestBenchSettings, progress=print) -> dict:
    counts = [int(w) for w in settings.workers]
    if not counts or min(counts) < 1 or settings.images < 1:
        raise ValueError("bench ingest: --images and every --workers value must be >= 1")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        size = photo_folder(settings, scratch / "photos")
        progress(f"bench ingest: {settings.images} JPEGs of {settings.width}x{settings.height}, "
                 f"{size / settings.images / 1024:.0f} KiB each")
        for workers in counts:
            for name, max_side in (("folder -> shards, JPEGs kept", None),
                                   (f"folder -> shards, --max-side {settings.max_side}", settings.max_side)):
                out = scratch / f"shards-{workers}-{max_side}"
                started = time.perf_counter()
                write_shards(image_folder(scratch / "photos"), out, ShardSettings(
                    samples_per_shard=settings.samples_per_shard, workers=workers, max_side=max_side), progress=False)
                rows.append(_row(name, workers, settings.images, time.perf_counter() - started))
            started = time.perf_counter()
            index_tars(scratch / f"shards-{workers}-None", scratch / f"index-{workers}", workers=workers,
                       progress=False)
            rows.append(_row("tars indexed in place", workers, settings.images, time.perf_counter() - started))
    return {"images": settings.images, "kib_per_image": size / settings.images / 1024, "rows": rows}


def _row(name: str, workers: int, images: int, seconds: float) -> dict:
    return {"run": name, "workers": workers, "seconds": seconds, "images_per_s": images / seconds,
            "per_worker": images / seconds / workers}


def format_report(summary: dict) -> str:
    lines = [f"bench ingest: {summary['images']} photo-like JPEGs, {summary['kib_per_image']:.0f} KiB each", "",
             "| run | workers | seconds | images/s | images/s per worker |", "|---|---|---|---|---|"]
    for row in summary["rows"]:
        lines.append(f"| {row['run']} | {row['workers']} | {row['seconds']:.1f} | {row['images_per_s']:.0f} | "
                     f"{row['per_worker']:.0f} |")
    return "\n".join(lines)
