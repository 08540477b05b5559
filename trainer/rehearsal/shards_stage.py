"""The rehearsal's data: N synthetic training images written as the k8s overlay writes a shard set
(K `make-shards --part I/K` processes side by side, then `merge-shards`), the labelled slice kNN
is scored on, and how long a rank takes to open the sample table of N ids."""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from trainer.rehearsal import processes
from trainer.rehearsal.processes import INSTCLS
from trainer.rehearsal.settings import RehearsalSettings

SAMPLES_PER_SHARD = 1000  # ImageNet-1K's config (configs/in1k_r50_64gpu.yaml): 1282 shards at N = 1.28M
# The demo's digit scenes (the Makefile's SCENES): labelled, real digits, so kNN has classes to find.
DIGIT_SCENES = ["--source", "digit-scenes", "--background", "flat", "--max-angle", "0", "--digit-size", "0.6", "0.8",
                "--colour-mix", "0.6", "--samples-per-shard", "256"]
TABLE_OPENS = 5


def write_training_shards(settings: RehearsalSettings) -> dict:
    """The parts in parallel (one worker process each: one core per part here), then the merge."""
    out, parts = settings.train_shards, settings.ingest_parts
    shutil.rmtree(out, ignore_errors=True)  # make-shards refuses to write over a finished shard set
    source = ["--source", "synthetic", "--count", str(settings.images), "--image-size", str(settings.image_size),
              "--samples-per-shard", str(SAMPLES_PER_SHARD), "--prefix", "train", "--out", str(out)]
    started = time.perf_counter()
    running = []
    for part in range(parts):
        output = settings.command_output / f"make-shards-part-{part}.txt"
        command = [*INSTCLS, "make-shards", *source, "--part", f"{part}/{parts}", "--workers", "1", "--no-progress"]
        running.append((processes.start(command, output), output, part))
    for process, output, part in running:
        if (code := process.wait()) != 0:
            for other, _, _ in running:
                other.kill()
            raise processes.fail(f"make-shards part {part}/{parts}", output, code)
    parts_seconds = time.perf_counter() - started
    merged = processes.run([*INSTCLS, "merge-shards", str(out)], settings.command_output / "merge-shards.txt",
                           "merge-shards")
    return {
        "images": settings.images,
        "image_size": settings.image_size,
        "parts": parts,
        "parts_seconds": parts_seconds,
        "merge_seconds": merged.seconds,
        "images_per_s": settings.images / parts_seconds,
        "bytes": directory_bytes(out),
    }


def write_knn_shards(settings: RehearsalSettings) -> dict:
    """The bank (the training digits, ``knn_bank_renders`` scenes each) and the held-out queries
    (the 20% held-out digits, one scene each).  The training images are noise without labels, so
    kNN scores the trained backbone's features on this labelled set instead."""
    for out in (settings.knn_bank_shards, settings.knn_query_shards):
        shutil.rmtree(out, ignore_errors=True)
    bank = processes.run(
        [*INSTCLS, "make-shards", *DIGIT_SCENES, "--split", "train", "--renders-per-digit",
         str(settings.knn_bank_renders), "--prefix", "bank", "--out", str(settings.knn_bank_shards), "--no-progress"],
        settings.command_output / "make-shards-knn-bank.txt", "make-shards (kNN bank)")
    queries = processes.run(
        [*INSTCLS, "make-shards", *DIGIT_SCENES, "--split", "val", "--renders-per-digit", "1", "--prefix", "queries",
         "--out", str(settings.knn_query_shards), "--no-progress"],
        settings.command_output / "make-shards-knn-queries.txt", "make-shards (kNN queries)")
    return {"bank_images": _instances(settings.knn_bank_shards), "query_images": _instances(settings.knn_query_shards),
            "seconds": bank.seconds + queries.seconds}


def time_sample_table_open(shard_dir: Path, global_batch: int) -> dict:
    """What a rank pays to open the table of every id at start-up (``SampleTable``, as the loaders
    open it), and one step's lookups: the rows and the image bytes of a global batch.  The page
    cache is warm (the merge just wrote the table), as on a node whose other ranks opened it."""
    from data_pipeline.shardset.sample_table import SampleTable

    opens = []
    for _ in range(TABLE_OPENS):
        started = time.perf_counter()
        table = SampleTable(shard_dir)
        opens.append(time.perf_counter() - started)
    ids = np.random.default_rng(0).choice(table.num_samples, size=global_batch, replace=False)
    started = time.perf_counter()
    image_bytes = sum(len(table.read_jpeg(int(i))) for i in ids)
    lookup_seconds = time.perf_counter() - started
    return {"first_open_s": opens[0], "median_open_s": statistics.median(opens), "ids": table.num_samples,
            "table_bytes": (shard_dir / "samples.npy").stat().st_size, "step_lookup_s": lookup_seconds,
            "step_lookup_images": global_batch, "step_lookup_bytes": image_bytes}


def _instances(shard_dir: Path) -> int:
    from data_pipeline.shardset.manifest import ShardManifest

    return ShardManifest.load(shard_dir).num_instances


def directory_bytes(path: Path) -> int:
    """Bytes on disk (allocated blocks, as `du`) of everything under ``path``."""
    total = 0
    for item in Path(path).rglob("*"):
        try:
            if item.is_file() and not item.is_symlink():
                total += item.stat().st_blocks * 512
        except FileNotFoundError:  # removed while counted (a checkpoint beyond keep_last)
            continue
    return total
