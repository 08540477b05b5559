"""Fixtures of the training tests."""

import pytest

from data_pipeline.shards import ShardSettings, write_shards
from data_pipeline.sources import sklearn_digits


@pytest.fixture(scope="session")
def digits_split(tmp_path_factory):
    """The digits as a training shard set and a held-out one (the demo's split)."""
    root = tmp_path_factory.mktemp("digits_split")
    for split in ("train", "val"):
        write_shards(sklearn_digits(32, split=split), root / split, ShardSettings(prefix=split, samples_per_shard=256),
                     progress=False)
    return {"train": root / "train", "val": root / "val"}
