"""Shard sets shared by the data tests (written once per session)."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_pipeline.shards import ShardSettings, write_shards
from data_pipeline.sources import image_folder, sklearn_digits

COLOR_IMAGES = 45


def solid_color(index: int) -> tuple[int, int, int]:
    """A distinct, JPEG-stable colour per image (well apart in every channel)."""
    return (40 + 40 * (index % 5), 40 + 40 * ((index // 5) % 5), 60 + 60 * (index // 25))


@pytest.fixture(scope="session")
def digits_shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("digits")
    write_shards(sklearn_digits(32), out, ShardSettings(prefix="digits", samples_per_shard=400), progress=False)
    return out


@pytest.fixture(scope="session")
def color_folder(tmp_path_factory) -> Path:
    """ROOT/<class>/<image>.png: uniform-colour 40x40 images; the class is index % 3."""
    root = tmp_path_factory.mktemp("colors")
    for index in range(COLOR_IMAGES):
        class_dir = root / f"class{index % 3}"
        class_dir.mkdir(exist_ok=True)
        pixels = np.zeros((40, 40, 3), dtype=np.uint8) + np.array(solid_color(index), dtype=np.uint8)
        Image.fromarray(pixels).save(class_dir / f"img{index:03d}.png")
    return root


@pytest.fixture(scope="session")
def color_shards(color_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("color_shards")
    write_shards(image_folder(color_folder), out, ShardSettings(prefix="colors", samples_per_shard=10), progress=False)
    return out
