"""Both loaders: epoch coverage across ranks, ids that match their images, views and shapes."""

import io

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from data_pipeline.augment import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig
from data_pipeline.loader import LoaderConfig, build_loader, steps_per_epoch
from data_pipeline.manifest import ShardManifest
from data_pipeline.shards import decode_int64

CPU = torch.device("cpu")
BACKENDS = ["dali", "torch"]


def run_epoch(loader):
    batches = list(loader)
    ids = torch.cat([b.instance_ids for b in batches])
    valid = torch.cat([b.valid for b in batches])
    return batches, ids, valid


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("last_batch", ["pad", "drop"])
def test_two_ranks_see_every_instance_once_per_epoch(digits_shards, backend, last_batch):
    config = LoaderConfig(batch_size=64, backend=backend, num_threads=2, last_batch=last_batch,
                          augment=AugmentConfig(image_size=32))
    loaders = [build_loader(digits_shards, config, rank, 2, CPU, train=True) for rank in range(2)]
    expected_steps = 15 if last_batch == "pad" else 14  # ranks hold 898 and 899 samples
    order_by_epoch = []
    for _ in range(2):
        epoch_ids = []
        for loader in loaders:
            batches, ids, valid = run_epoch(loader)
            assert len(batches) == len(loader) == expected_steps
            for batch in batches:
                assert [tuple(v.shape) for v in batch.views] == [(64, 3, 32, 32)] * 2
                assert all(v.dtype == torch.float32 for v in batch.views)
                assert batch.instance_ids.dtype == torch.int64 and batch.instance_ids.shape == (64,)
            epoch_ids.append(ids[valid])
            assert valid.sum() == len(set(ids.tolist())), "valid marks exactly the first sighting of each id"
        union = torch.cat(epoch_ids).sort().values
        if last_batch == "pad":
            assert union.tolist() == list(range(1797))
        else:
            assert len(union) == 2 * 14 * 64 and union.unique().numel() == len(union)
        assert set(epoch_ids[0].tolist()).isdisjoint(epoch_ids[1].tolist())
        order_by_epoch.append(epoch_ids[0].tolist())
    assert order_by_epoch[0] != order_by_epoch[1], "sample order should change between epochs"


def stored_colors(shard_dir):
    """id -> (mean RGB of the stored image, label), read straight from the tars."""
    manifest = ShardManifest.load(shard_dir)
    truth = {}
    for sample in wds.DataPipeline(wds.SimpleShardList(manifest.tar_paths(shard_dir)), wds.tarfile_to_samples()):
        rgb = np.asarray(Image.open(io.BytesIO(sample["jpg"])).convert("RGB"), dtype=np.float64)
        truth[decode_int64(sample["id"])] = (rgb.reshape(-1, 3).mean(axis=0), decode_int64(sample["cls"]))
    return truth


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_travel_with_their_images_and_views_are_normalised(color_shards, backend):
    """Every image is one solid colour, so any crop or flip of it must show that id's colour."""
    truth = stored_colors(color_shards)
    no_colour_change = AugmentConfig(image_size=16, jitter_prob=0, grayscale_prob=0, blur_prob=0, small_crops=1,
                                     small_size=8)
    config = LoaderConfig(batch_size=8, backend=backend, num_threads=1, augment=no_colour_change)
    mean = torch.tensor(IMAGENET_MEAN)[None, :, None, None]
    std = torch.tensor(IMAGENET_STD)[None, :, None, None]
    for train in (True, False):
        _, ids, valid = run_epoch(build_loader(color_shards, config, 0, 1, CPU, train=train))
        assert sorted(ids[valid].tolist()) == list(range(45))
        for batch in build_loader(color_shards, config, 0, 1, CPU, train=train):
            assert len(batch.views) == (3 if train else 1)
            for view in batch.views:
                rgb = ((view * std + mean) * 255).mean(dim=(2, 3))
                for row, instance_id in enumerate(batch.instance_ids.tolist()):
                    colour, label = truth[instance_id]
                    assert np.abs(rgb[row].numpy() - colour).max() < 3, f"id {instance_id} carries another image"
                    if not train:
                        assert batch.labels[row].item() == label
            if train:
                assert [v.shape[-1] for v in batch.views] == [16, 16, 8]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_two_views_of_an_image_differ(digits_shards, backend):
    config = LoaderConfig(batch_size=32, backend=backend, num_threads=2, augment=AugmentConfig(image_size=32))
    batch = next(iter(build_loader(digits_shards, config, 0, 1, CPU, train=True)))
    per_sample_gap = (batch.views[0] - batch.views[1]).abs().flatten(1).mean(dim=1)
    assert (per_sample_gap > 0.05).float().mean() > 0.9
    normalised = torch.cat([v.flatten() for v in batch.views])
    assert -3 < normalised.mean() < 3 and normalised.std() > 0.3


def test_too_small_data_for_the_ranks_is_explained():
    with pytest.raises(ValueError, match="use fewer ranks, a smaller batch"):
        steps_per_epoch(num_samples=100, world_size=4, batch_size=64, last_batch="drop")
