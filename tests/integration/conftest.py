"""Fixtures of the training tests."""

import re
import shlex
from pathlib import Path

import pytest

from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.sources.generated import Source, sklearn_digits


@pytest.fixture(scope="session")
def digits_split(tmp_path_factory):
    """The digits as a training shard set and a held-out one (the demo's split)."""
    root = tmp_path_factory.mktemp("digits_split")
    for split in ("train", "val"):
        write_shards(sklearn_digits(32, split=split), root / split, ShardSettings(prefix=split, samples_per_shard=256),
                     progress=False)
    return {"train": root / "train", "val": root / "val"}


@pytest.fixture(scope="session")
def tiny_digits_split(tmp_path_factory):
    """128 training digits and 64 held-out ones: 2 steps an epoch on 2 ranks of the demo's 32, for
    tests that need a whole run (epochs, evaluations, the summary) in seconds."""
    root = tmp_path_factory.mktemp("tiny_digits_split")
    for split, count in (("train", 128), ("val", 64)):
        digits = sklearn_digits(32, split=split)
        write_shards(Source(digits.name, digits.images[:count], digits.class_names), root / split,
                     ShardSettings(prefix=split, samples_per_shard=64), progress=False)
    return {"train": root / "train", "val": root / "val"}


REPO = Path(__file__).resolve().parents[2]


def demo_scene_arguments() -> list[str]:
    """The make-shards flags of the Makefile's SCENES, so the tests check exactly what `make demo` runs."""
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    return shlex.split(re.search(r"^SCENES := (.+)$", makefile, re.M).group(1))


@pytest.fixture(scope="session")
def scene_shards(tmp_path_factory):
    """The demo's digit scenes (train and held-out val), built as `make demo` builds them."""
    from trainer.cli import main

    root = tmp_path_factory.mktemp("scenes")
    for split in ("train", "val"):
        assert main(["make-shards", *demo_scene_arguments(), "--split", split, "--out", str(root / split)]) == 0
    return {"train": root / "train", "val": root / "val"}


@pytest.fixture(scope="session")
def drill_context(tmp_path_factory):
    """The fault drills' shared inputs (digits, the uninterrupted 4-step run, the run stopped at step
    2), built once for the single-node and the two-node drills alike."""
    from trainer.drills.catalogue import DrillContext

    return DrillContext(tmp_path_factory.mktemp("drills"))
