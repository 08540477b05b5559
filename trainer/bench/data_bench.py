"""`instcls bench data`: images/s of the DALI loader and the PIL + torchvision fallback on the same
shards, with the same views, batch size and number of CPU threads (DALI threads = DataLoader workers)."""

from __future__ import annotations

import itertools
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.augment import AugmentConfig
from data_pipeline.config import LoaderConfig
from data_pipeline.loader import build_loader
from data_pipeline.shards import ShardSettings, write_shards
from data_pipeline.sources import synthetic


@dataclass(frozen=True)
class DataBenchSettings:
    shards: Path | None = None  # None: write synthetic shards to a temporary directory
    synthetic_count: int = 2048
    image_size: int = 224  # size of the synthetic images on disk
    crop_size: int = 224
    views: int = 2
    small_crops: int = 0
    batch: int = 64
    threads: int = 2
    batches: int = 20
    warmup: int = 2


def _images_per_second(shard_dir: Path, backend: str, settings: DataBenchSettings, device: torch.device) -> float:
    augment = AugmentConfig(image_size=settings.crop_size, num_views=settings.views, small_crops=settings.small_crops,
                            small_size=max(8, settings.crop_size * 96 // 224))
    config = LoaderConfig(batch_size=settings.batch, backend=backend, num_threads=settings.threads, augment=augment)
    loader = build_loader(shard_dir, config, rank=0, world_size=1, device=device, train=True)
    images, start = 0, None
    for epoch in itertools.count():  # several epochs if the shard set is small
        for batch in loader.epoch_batches(epoch):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if start is None and images >= settings.warmup * settings.batch:
                start, images = time.perf_counter(), 0
            images += batch.instance_ids.shape[0]
            if start is not None and images >= settings.batches * settings.batch:
                return images / (time.perf_counter() - start)


def run(settings: DataBenchSettings) -> dict:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        shard_dir = settings.shards
        if shard_dir is None:
            shard_dir = Path(tmp)
            source = synthetic(settings.synthetic_count, settings.image_size)
            write_shards(source, shard_dir, ShardSettings(prefix="bench", samples_per_shard=512), progress=False)
        rates = {backend: _images_per_second(shard_dir, backend, settings, device) for backend in ("dali", "torch")}
    return dict(device=device.type, dali_images_per_s=rates["dali"], torch_images_per_s=rates["torch"],
                dali_over_torch=rates["dali"] / rates["torch"])


def format_report(settings: DataBenchSettings, summary: dict) -> str:
    views = f"{settings.views} x {settings.crop_size}px" + (
        f" + {settings.small_crops} small" if settings.small_crops else "")
    return "\n".join([
        f"data loading on {summary['device']}: batch {settings.batch}, views {views}, {settings.threads} threads/workers, "
        f"{settings.batches} batches after {settings.warmup} warm-up",
        f"{'loader':<28}{'images/s':>10}",
        f"{'DALI':<28}{summary['dali_images_per_s']:>10.1f}",
        f"{'PIL + torchvision':<28}{summary['torch_images_per_s']:>10.1f}",
        f"DALI / fallback: {summary['dali_over_torch']:.2f}x",
    ])
