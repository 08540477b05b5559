"""``build_loader``: the one way the trainer, evaluation and benchmarks get batches.

Imports go one way: this module -> ``dali`` / ``fallback`` -> ``indexed_loader`` -> shared types
(``config``, ``batch``, ``sampler``).  The backends are imported when chosen, so the fallback
runs where DALI is not installed.
"""

from __future__ import annotations

import torch

from data_pipeline.loading.base_loader import IndexedLoader
from data_pipeline.loading.loader_config import LoaderConfig
from data_pipeline.loading.samplers.base import Sampler
from data_pipeline.storage.shard_url import ShardLocation, shard_location


def build_loader(shard_dir: ShardLocation | str, config: LoaderConfig, rank: int, world_size: int, device: torch.device,
                 train: bool, sampler: Sampler | None = None) -> IndexedLoader:
    """The loader chosen by ``config.backend``.

    ``train=True``: augmented views (``config.augment``), default sampler a seeded permutation
    per epoch.  ``train=False``: the inference view (resize + centre crop), semantic labels, default
    sampler the stored order, padded.  ``sampler`` replaces the default; its ``world_size`` and
    ``batch_size`` must be the loader's.

    Use ``loader.epoch_batches(epoch, start_step)`` (``steps_per_epoch == len(loader)`` steps per
    epoch): it starts at ``start_step`` without reading anything before it.
    """
    if config.backend == "dali":
        from data_pipeline.loading.dali_loader import DaliLoader

        return DaliLoader(shard_location(shard_dir), config, rank, world_size, device, train, sampler,
                          read_threads=config.num_threads)
    from data_pipeline.loading.torchvision_loader import TorchLoader

    return TorchLoader(shard_location(shard_dir), config, rank, world_size, device, train, sampler)
