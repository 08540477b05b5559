"""The bookkeeping `instcls bench scale` times at a given N, each a call into the project's own
code with synthetic inputs (no images): the sample table, the samplers, the hard-negative index,
PIC's recent ids and a checkpoint's row re-split.

Each ``prepare_*`` builds its inputs untimed and returns the callable that is timed.  Per-step
items run ``steps`` steps per call and report per step.
"""

from __future__ import annotations

import json
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import webdataset as wds

from data_pipeline.loading.samplers.epoch_permutation import EpochPermutationSampler
from data_pipeline.loading.samplers.sliding_window import SlidingWindowSampler
from data_pipeline.shardset.manifest import FORMAT, LEGACY_FORMAT, MANIFEST_NAME
from data_pipeline.shardset.sample_ids import encode_int64
from data_pipeline.shardset.sample_table import SampleTable
from data_pipeline.shardset.table_file import ROW, TABLE_NAME, write_table
from data_pipeline.shardset.tar_index import scan_tar, write_dali_index
from trainer.classifier.hard_negatives import HardNegativeIndex
from trainer.classifier.sharding import ClassShard
from trainer.objectives.pic.objective import PicObjective
from trainer.objectives.pic.recent_ids import RecentIds
from trainer.parallel.sharded_state import ShardedRows, assemble_rows

LEGACY_SAMPLES = 20_000  # a format-1 set this big (or N/4) is parsed; the cost per sample is scaled to N


@dataclass(frozen=True)
class Scale:
    num_samples: int
    ranks: int
    batch: int
    new_ranks: int
    dim: int
    top_k: int
    queue_size: int
    samples_per_shard: int
    steps: int

    @property
    def global_batch(self) -> int:
        return self.ranks * self.batch

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.num_samples // self.global_batch)

    def timed_steps(self) -> range:
        """Mid-epoch steps whose next step is in the same epoch (at most ``steps`` of them)."""
        start = self.steps_per_epoch // 2 if self.steps_per_epoch > 2 * self.steps else 0
        return range(start, min(start + self.steps, self.steps_per_epoch - 1))


def _manifest(directory: Path, counts: list[int], legacy: bool, table_sha256: str | None = None) -> None:
    first_ids = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    shards = [{"tar": f"s-{n:06d}.tar", "index": f"s-{n:06d}.idx", "count": count, "first_id": first,
               "sha256": "0" * 64} for n, (count, first) in enumerate(zip(counts, first_ids))]
    manifest = {"num_instances": int(sum(counts)), "shards": shards, "source": "bench", "class_names": None,
                "format": LEGACY_FORMAT if legacy else FORMAT}
    if not legacy:
        manifest |= {"table": TABLE_NAME, "table_sha256": table_sha256}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def prepare_table_write(scale: Scale, work: Path):
    """Rows as the merge has them; timed: writing ``samples.npy`` (once per ingest)."""
    n, per = scale.num_samples, scale.samples_per_shard
    rows = np.zeros(n, dtype=ROW)
    positions = np.arange(n, dtype=np.int64)
    rows["shard"] = positions // per
    rows["size"] = 100_000
    rows["offset"] = (positions % per) * 101_376 + 1536
    rows["label"] = positions % 21_841
    directory = work / f"table-{n}"
    directory.mkdir(exist_ok=True)

    def write():
        digest = write_table(directory / TABLE_NAME, rows)
        counts = [per] * (n // per) + ([n % per] if n % per else [])
        _manifest(directory, counts, legacy=False, table_sha256=digest)
    return write, directory


def prepare_table_open(scale: Scale, directory: Path):
    """Timed: opening the table as every process does (manifest + mapping + checks), then one
    step's lookups, so the table is used, not just opened."""
    ids = np.random.default_rng(0).integers(0, scale.num_samples, scale.batch)

    def open_and_look_up():
        table = SampleTable(directory)
        table.rows[ids]["size"].sum()
        return table  # kept while the bench reads how many of its pages are mapped
    return open_and_look_up


def legacy_samples(scale: Scale) -> int:
    return min(LEGACY_SAMPLES, max(scale.num_samples // 4, 1))


def prepare_legacy_parse(scale: Scale, work: Path):
    """A format-1 set of ``legacy_samples`` (v1 keys, .id/.cls, DALI index files); timed: building
    its table in memory as a loader does.  Reported per sample x N."""
    per, counts, total = scale.samples_per_shard, [], legacy_samples(scale)
    directory = work / f"legacy-{total}"
    if not directory.is_dir():
        directory.mkdir()
        for first in range(0, total, per):
            _write_legacy_shard(directory, first, min(first + per, total), per)
            counts.append(min(per, total - first))
        _manifest(directory, counts, legacy=True)

    def parse():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return SampleTable(directory).num_samples
    return parse


def _write_legacy_shard(directory: Path, first: int, end: int, per: int) -> None:
    tar = directory / f"s-{first // per:06d}.tar"
    with wds.TarWriter(str(tar), mtime=0) as writer:
        for i in range(first, end):
            writer.write({"__key__": f"{i:010d}", "jpg": b"\xff\xd8", "id": encode_int64(i),
                          "cls": encode_int64(i % 7)})
    write_dali_index(scan_tar(tar), tar, tar.with_suffix(".idx"))


def prepare_epoch_permutation(scale: Scale):
    sampler = EpochPermutationSampler(scale.num_samples, scale.ranks, scale.batch, seed=0)
    return lambda: sampler.epoch_order(1).size, sampler


def prepare_sliding_window(scale: Scale):
    """Timed: the sampler's one permutation (per run), then the first window."""
    def build():
        sampler = SlidingWindowSampler(scale.num_samples, scale.ranks, scale.batch, seed=0)
        return sampler.window(0).size
    return build


def prepare_step_plan(scale: Scale, sampler):
    """Timed per step: this step's and the next step's ids of every rank, as the step reader asks."""
    steps = scale.timed_steps()
    sampler.step(1, steps[0])  # the epoch's order exists already, as it does after the epoch's first step

    def run():
        for step in steps:
            _ = sampler.step(1, step).global_valid  # the reader sums the step's valid samples
            sampler.step(1, step + 1)
    return run, len(steps)


def prepare_window_steps(scale: Scale):
    sampler = SlidingWindowSampler(scale.num_samples, scale.ranks, scale.batch, seed=0)
    steps = scale.timed_steps()

    def run():
        for step in steps:
            sampler.step(1, step)
            sampler.step(1, step + 1)
    return run, len(steps)


def prepare_hard_negative_index(scale: Scale):
    """One rank's owner-side table ``[N/T, K]``; timed: inverting it into the lookup index (once
    per search, i.e. per epoch), without the all-to-all (its volume is the same)."""
    shard = ClassShard(scale.num_samples, scale.ranks, 0)
    rng = np.random.default_rng(0)
    owner = torch.from_numpy(rng.integers(0, scale.num_samples, (shard.num_classes_local, scale.top_k)))
    holder = {}

    def build():
        holder["index"] = HardNegativeIndex(owner, shard, group=None)
    return build, holder


def prepare_hard_negative_lookup(scale: Scale, holder: dict):
    rng = np.random.default_rng(1)
    batches = [torch.from_numpy(rng.integers(0, scale.num_samples, scale.global_batch)) for _ in range(scale.steps)]

    def steps():
        for ids in batches:
            holder["index"].local_columns(ids)
    return steps


def prepare_recent_ids(scale: Scale):
    """PIC's queue of the K most recent ids and the sampled rows of rank 0, per step (the
    objective's own methods, on a stand-in for the objective's state)."""
    pic = types.SimpleNamespace(config=types.SimpleNamespace(negatives="recent"), recent=RecentIds(scale.queue_size),
                                shard=ClassShard(scale.num_samples, scale.ranks, 0))
    rng = np.random.default_rng(2)
    plans = [types.SimpleNamespace(ids=rng.integers(0, scale.num_samples, scale.global_batch),
                                   valid=np.ones(scale.global_batch, dtype=bool)) for _ in range(scale.steps)]
    while pic.recent.ids().size < scale.queue_size:
        pic.recent.push(rng.integers(0, scale.num_samples, scale.global_batch))

    def steps():
        for plan in plans:
            sampled = PicObjective._sampled_ids(pic, plan)
            PicObjective._local_rows(pic, sampled)
            pic.recent.push(plan.ids)
    return steps


def prepare_row_resplit(scale: Scale, work: Path):
    """A checkpoint's classifier rows ``[N, D]`` float32 as T memory-mapped pieces (a sparse file:
    no disk is written); timed: assembling rank 0's rows for T' ranks, as a resume does."""
    n, dim = scale.num_samples, scale.dim
    path = work / f"rows-{n}.f32"
    mapped = np.memmap(path, dtype=np.float32, mode="w+", shape=(n, dim))
    whole = torch.from_numpy(mapped)
    saved = []
    for rank in range(scale.ranks):
        old = ClassShard(n, scale.ranks, rank)
        saved.append({"__sharded_rows__": True, "start": old.class_start, "end": old.class_end, "total": n,
                      "present": True, "rows": whole[old.class_start:old.class_end]})
    new = ClassShard(n, scale.new_ranks, 0)
    template = ShardedRows(None, new.class_start, new.class_end, n)

    def resplit():
        return assemble_rows(template, saved, "objective.rows", torch.device("cpu"))
    return resplit
