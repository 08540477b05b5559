"""The ViT probe's reader of make-shards folders: every sample once, each image with its own label
(make-shards stores them shuffled, so each image is matched to its nearest source image); a folder
without shards is refused with the command that writes them."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.sources.generated import sklearn_digits
from scripts.research.vit_scenes_probe import load_split


def test_reads_every_sample_with_its_own_label(tmp_path):
    source = sklearn_digits(16, split="val")
    write_shards(source, tmp_path, ShardSettings(samples_per_shard=100), progress=False)
    images, labels = load_split(str(tmp_path))
    assert images.shape == (len(source.images), 3, 16, 16) and images.dtype == torch.uint8
    originals = torch.tensor(np.stack([np.asarray(Image.open(io.BytesIO(image.read())).convert("RGB"))
                                       for image in source.images])).permute(0, 3, 1, 2).float()
    distance = torch.cdist(images.float().flatten(1), originals.flatten(1))
    nearest = distance.argmin(dim=1)
    assert sorted(nearest.tolist()) == list(range(len(source.images)))  # each source image read once
    assert labels.tolist() == [source.images[i].label for i in nearest.tolist()]


def test_a_folder_without_shards_names_the_command(tmp_path):
    with pytest.raises(SystemExit, match="make demo"):
        load_split(str(tmp_path))
