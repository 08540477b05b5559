"""`instcls bench data`: images/s of the DALI loader and the PIL + torchvision fallback on the same
shards, with the same views, batch size and number of CPU threads (DALI threads = DataLoader workers).

Two view recipes are measured in the same run: the configured global views, and the same plus
SwAV's multi-crop (6 small views of 96/224 of the crop size, scale 0.05-0.14; global views at scale
0.14-1), so the cost of multi-crop is read off one table."""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path

import torch

from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.sources.generated import synthetic
from data_pipeline.loading.augment.augment_config import AugmentConfig
from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.loader_config import LoaderConfig
from trainer.bench.settings.data import DataBenchSettings


def view_recipes(settings: DataBenchSettings) -> dict[str, AugmentConfig]:
    """The configured views and, unless they already have small crops, SwAV's multi-crop."""
    small_size = max(8, settings.crop_size * 96 // 224)
    configured = AugmentConfig(image_size=settings.crop_size, num_views=settings.views,
                               small_crops=settings.small_crops, small_size=small_size)
    recipes = {_describe(configured): configured}
    if settings.multicrop and not settings.small_crops:
        multicrop = AugmentConfig(image_size=settings.crop_size, num_views=settings.views, crop_scale=(0.14, 1.0),
                                  small_crops=settings.multicrop, small_size=small_size, small_scale=(0.05, 0.14))
        recipes[_describe(multicrop)] = multicrop
    return recipes


def _describe(augment: AugmentConfig) -> str:
    views = f"{augment.num_views} x {augment.image_size}px"
    return views + (f" + {augment.small_crops} x {augment.small_size}px" if augment.small_crops else "")


def synthetic_shards(directory: Path, count: int, image_size: int) -> Path:
    """``count`` random images of ``image_size`` pixels as a shard set in ``directory``."""
    write_shards(synthetic(count, image_size), directory, ShardSettings(prefix="bench", samples_per_shard=512),
                 progress=False)
    return directory


def loader_images_per_second(loader, device: torch.device, warmup: int, batches: int) -> float:
    """Images/s of ``loader`` over ``batches`` batches after ``warmup`` untimed ones (as many epochs
    as that takes), each batch on the device before it counts."""
    images, start, index = 0, None, 0
    for epoch in itertools.count():  # several epochs if the shard set is small
        for batch in loader.epoch_batches(epoch):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if start is None and index >= warmup:
                start, images = time.perf_counter(), 0
            images += batch.instance_ids.shape[0]
            index += 1
            if start is not None and index >= warmup + batches:
                return images / (time.perf_counter() - start)


def _images_per_second(shard_dir: Path, backend: str, augment: AugmentConfig, settings: DataBenchSettings,
                       device: torch.device) -> float:
    config = LoaderConfig(batch_size=settings.batch, backend=backend, num_threads=settings.threads, augment=augment)
    loader = build_loader(shard_dir, config, rank=0, world_size=1, device=device, train=True)
    return loader_images_per_second(loader, device, settings.warmup, settings.batches)


def run(settings: DataBenchSettings) -> dict:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        shard_dir = settings.shards or synthetic_shards(Path(tmp), settings.synthetic_count, settings.image_size)
        rows = []
        for views, augment in view_recipes(settings).items():
            rates = {backend: _images_per_second(shard_dir, backend, augment, settings, device)
                     for backend in ("dali", "torch")}
            rows.append(dict(views=views, dali_images_per_s=rates["dali"], torch_images_per_s=rates["torch"],
                             dali_over_torch=rates["dali"] / rates["torch"]))
    return dict(device=device.type, recipes=rows, **{k: v for k, v in rows[0].items() if k != "views"})


def format_report(settings: DataBenchSettings, summary: dict) -> str:
    lines = [
        f"data loading on {summary['device']}: batch {settings.batch}, {settings.threads} threads/workers, "
        f"{settings.batches} batches after {settings.warmup} warm-up",
        f"{'views':<28}{'DALI img/s':>12}{'fallback img/s':>16}{'DALI/fallback':>15}",
    ]
    for row in summary["recipes"]:
        lines.append(f"{row['views']:<28}{row['dali_images_per_s']:>12.1f}{row['torch_images_per_s']:>16.1f}"
                     f"{row['dali_over_torch']:>14.2f}x")
    if len(summary["recipes"]) == 2:
        plain, multicrop = summary["recipes"]
        lines.append(f"multi-crop images/s vs {plain['views']}: DALI "
                     f"{multicrop['dali_images_per_s'] / plain['dali_images_per_s']:.2f}x, fallback "
                     f"{multicrop['torch_images_per_s'] / plain['torch_images_per_s']:.2f}x")
    return "\n".join(lines)
