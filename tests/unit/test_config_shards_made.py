"""Every shard folder under out/ that a shipped config reads is written by a make target, so a
user who runs a config from the docs on a fresh clone is one `make` away from its data."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

# Where each generated shard set comes from: a make target whose dry run shows the folder written
# (``--out FOLDER``), or the rehearsal, whose stages write theirs from Python (`make rehearsal`).
MADE_BY = {"out/demo/": "demo", "out/digits/": "digits", "out/rehearsal/": "rehearsal"}
WRITTEN_IN_PYTHON = {"rehearsal"}


def _generated_shard_folders() -> dict[str, str]:
    """Shard folder under out/ -> the config that reads it."""
    folders = {}
    for config in sorted((REPO / "configs").glob("*.yaml")):
        data = (yaml.safe_load(config.read_text()) or {}).get("data", {})
        for key in ("train_shards", "eval_shards", "knn_bank_shards"):
            if str(data.get(key, "")).startswith("out/"):
                folders[data[key]] = config.name
    return folders


def test_the_configs_read_generated_shards():
    assert {"out/digits/shards/train", "out/demo/shards/val"} <= set(_generated_shard_folders())


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_each_generated_shard_folder_has_a_make_target_that_writes_it():
    folders = _generated_shard_folders()
    unmade = {folder: config for folder, config in folders.items()
              if not any(folder.startswith(prefix) for prefix in MADE_BY)}
    assert not unmade, f"no make target writes these shard folders (config: folder): {unmade}"
    targets = sorted({MADE_BY[prefix] for folder in folders for prefix in MADE_BY if folder.startswith(prefix)}
                     - WRITTEN_IN_PYTHON)
    # -B: as if nothing were built yet; INSTALLED=: the venv's rule is not needed to print the recipes
    dry_run = subprocess.run(["make", "-n", "-B", "INSTALLED=", *targets], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
    for folder, config in folders.items():
        prefix = next(prefix for prefix in MADE_BY if folder.startswith(prefix))
        if MADE_BY[prefix] not in WRITTEN_IN_PYTHON:
            assert f"--out {folder} " in dry_run, f"`make {MADE_BY[prefix]}` does not write {folder} ({config})"
