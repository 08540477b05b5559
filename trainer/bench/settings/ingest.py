"""`instcls bench ingest`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IngestBenchSettings:
    """Attributes:
    images: JPEGs in the folder.
    width, height: their size (ImageNet's median is about 500 x 375).
    quality: their JPEG quality.
    workers: the worker counts to measure, comma-separated (at most one per core for per-core figures).
    max_side: the --max-side of the shrinking run.
    samples_per_shard: shard size.
    """

    images: int = 2000
    width: int = 500
    height: int = 375
    quality: int = 90
    workers: tuple[str, ...] = ("1", "2")
    max_side: int = 256
    samples_per_shard: int = 250
