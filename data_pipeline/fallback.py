"""The fallback loader: webdataset + torchvision.transforms.v2 in DataLoader worker processes.

Same epoch semantics as the DALI loader (see ``data_pipeline.loader``) and the same augmentation
recipe; it is selectable with ``data.backend: torch`` and is the baseline of ``instcls bench data``.
Differences from DALI that do not change the recipe: colour-jitter steps run in a random order
(torchvision) instead of a fixed one, and the blur kernel is fixed at ``2*ceil(3*sigma_max)+1``
pixels, the window DALI derives from the largest sigma.
"""

from __future__ import annotations

import itertools
import math
import random

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchvision.transforms import v2

from data_pipeline.augment import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig
from data_pipeline.loader import Batch, EpochLoader, LoaderConfig, epoch_seed, epoch_shard_order, rank_range
from data_pipeline.shards import decode_int64


def view_transform(size: int, area: tuple[float, float], augment: AugmentConfig) -> v2.Transform:
    brightness, contrast, saturation, hue = augment.jitter
    blur_kernel = 2 * math.ceil(3 * augment.blur_sigma[1]) + 1
    return v2.Compose(
        [
            v2.RandomResizedCrop(size, scale=area, ratio=(3 / 4, 4 / 3), antialias=True),
            v2.RandomHorizontalFlip(p=augment.flip_prob),
            v2.RandomApply([v2.ColorJitter(brightness, contrast, saturation, hue)], p=augment.jitter_prob),
            v2.RandomGrayscale(p=augment.grayscale_prob),
            v2.RandomApply([v2.GaussianBlur(blur_kernel, sigma=augment.blur_sigma)], p=augment.blur_prob),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def eval_transform(augment: AugmentConfig) -> v2.Transform:
    size = augment.image_size
    return v2.Compose(
        [
            v2.Resize(round(size * augment.eval_resize), antialias=True),
            v2.CenterCrop(size),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


class _RankSamples(IterableDataset):
    """This rank's contiguous range of the epoch's sample sequence, dealt round-robin to workers."""

    def __init__(self, urls: list[str], skip: int, take: int, config: LoaderConfig, train: bool, seed: int) -> None:
        self.urls, self.skip, self.take = urls, skip, take
        self.shuffle_buffer = config.shuffle_buffer if train else 1
        self.seed = seed
        if train:
            self.transforms = [view_transform(size, area, config.augment) for size, area in config.augment.view_specs()]
        else:
            self.transforms = [eval_transform(config.augment)]

    def _mine(self, samples):
        worker = get_worker_info()
        num_workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        for position, sample in enumerate(samples):
            if position % num_workers == worker_id:
                yield sample

    def _to_views(self, sample):
        image = v2.functional.to_image(sample["jpg"])
        return [t(image) for t in self.transforms], decode_int64(sample["id"]), decode_int64(sample["cls"])

    def __iter__(self):
        worker = get_worker_info()
        rng = random.Random(self.seed * 100 + (worker.id if worker else 0))  # the in-stream shuffle
        pipeline = wds.DataPipeline(
            wds.SimpleShardList(self.urls),
            wds.tarfile_to_samples(),
            wds.slice(self.skip, self.skip + self.take),
            self._mine,
            wds.shuffle(self.shuffle_buffer, initial=min(self.shuffle_buffer, 100), rng=rng),
            wds.decode("pil", only=["jpg"]),
            wds.map(self._to_views),
        )
        return iter(pipeline)


class TorchLoader(EpochLoader):
    """Iterate once per epoch; yields ``Batch`` on ``device`` (same contract as ``DaliLoader``)."""

    def _epoch_dataset(self) -> _RankSamples:
        shards = self.manifest.shards
        order = epoch_shard_order(len(shards), self.config.seed, self.epoch, shuffle=self.train)
        start, end = rank_range(self.num_instances, self.rank, self.world_size)
        urls, skip, position = [], 0, 0
        for index in order:
            shard = shards[index]
            if position + shard.count > start and position < end:
                if not urls:
                    skip = start - position
                urls.append(str(self.shard_dir / shard.tar))
            position += shard.count
        return _RankSamples(urls, skip, end - start, self.config, self.train, epoch_seed(self.config.seed, self.epoch, self.rank))

    def __iter__(self):
        self._first_sightings.new_epoch()
        dataset = self._epoch_dataset()
        # Worker RNGs (the torchvision transforms) are seeded from this generator: reproducible epochs.
        generator = torch.Generator().manual_seed(epoch_seed(self.config.seed, self.epoch, self.rank))
        loader = DataLoader(dataset, batch_size=None, num_workers=self.config.num_threads, prefetch_factor=4,
                            generator=generator)
        self.epoch += 1
        samples = iter(loader)
        batch_size = self.config.batch_size
        previous: list = []  # the last batch: padding repeats come from it, never from the whole epoch
        for _ in range(self.steps_per_epoch):
            chunk = list(itertools.islice(samples, batch_size))
            pool = list(chunk) or previous
            while len(chunk) < batch_size:  # "pad": repeat samples this rank already read this epoch
                chunk.append(pool[len(chunk) % len(pool)])
            previous = chunk
            yield self._collate(chunk)

    def _collate(self, chunk) -> Batch:
        views = [torch.stack([sample[0][v] for sample in chunk]) for v in range(self.num_views)]
        ids = torch.tensor([sample[1] for sample in chunk], dtype=torch.int64)
        labels = None if self.train else torch.tensor([sample[2] for sample in chunk], dtype=torch.int64)
        return self._batch(views, ids, labels)
