"""`instcls bench data`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DataBenchSettings:
    """Attributes:
    shards: shard directory (default: synthetic shards written to a temporary directory).
    synthetic_count: images in the synthetic shards.
    image_size: side of the synthetic images on disk.
    crop_size: side of the global views.
    views: global views per image.
    small_crops: small views per image in the configured recipe.
    batch: images per batch.
    threads: DALI threads = DataLoader workers.
    batches: timed batches.
    warmup: untimed batches.
    multicrop: small views of the multi-crop recipe measured next to the configured views (0: only
        the configured views).
    """

    shards: Path | None = None
    synthetic_count: int = 2048
    image_size: int = 224
    crop_size: int = 224
    views: int = 2
    small_crops: int = 0
    batch: int = 64
    threads: int = 2
    batches: int = 20
    warmup: int = 2
    multicrop: int = 6
