"""`instcls make-shards`: images -> WebDataset tar shards + DALI index files + sample table + manifest.

The listing is shuffled with the seed (stored order = training read order within a shard, so
shards are not class-sorted) and cut into shards of ``samples_per_shard`` images before anything
is written: shard j holds positions ``[j*S, (j+1)*S)`` of that order, minus the images that fail
to decode.  A part of several holds only its shards' images (``data_pipeline.ingest.part_listing``).
Shards are written in parallel (``data_pipeline.ingest.parallel_ingest``), each by
``data_pipeline.ingest.shard_writer``; the merge (``data_pipeline.ingest.shard_merge``) then numbers the
samples 0..N-1 in shard order and writes the manifest last.  ``--out s3://bucket/prefix`` writes
the same files through a local staging directory (``data_pipeline.ingest.s3_ingest``).
"""

from __future__ import annotations

from pathlib import Path

from data_pipeline.ingest.ingest_state import IngestPlan, Part
from data_pipeline.ingest.parallel_ingest import open_target, run_ingest
from data_pipeline.ingest.part_listing import list_part
from data_pipeline.ingest.shard_settings import ShardSettings
from data_pipeline.ingest.shard_writer import BadImageError, ShardJob, checked_jpeg, shard_name, write_shard
from data_pipeline.ingest.sources.generated import Source
from data_pipeline.shardset.manifest import ShardManifest
from data_pipeline.shardset.sample_ids import decode_int64, encode_int64
from data_pipeline.shardset.table_file import sha256_of

__all__ = ["BadImageError", "ShardSettings", "checked_jpeg", "decode_int64", "encode_int64", "sha256_of",
           "write_shards"]


def write_shards(source: Source, out_dir: Path | str, settings: ShardSettings, progress: bool = True,
                 part: Part = Part(), staging: Path | str | None = None) -> ShardManifest | None:
    """Write ``part`` of the shards of ``source`` (resuming a killed run), and, for the only part,
    the manifest; returns it (None for one part of several: ``merge_shards`` comes after all).
    A part holds only its share of the listing (``part_listing``).  ``out_dir`` may be an
    ``s3://`` prefix, written through the local directory ``staging`` (``s3_ingest``), or a target
    ``parallel_ingest.open_target`` made."""
    target = open_target(out_dir, staging)  # a finished set or an unreachable bucket stops it before the listing
    size = settings.samples_per_shard
    if len(source.images) == 0:
        raise BadImageError(f"{source.name} lists no images")
    listing = list_part(source, size, settings.seed, part)
    count = listing.count
    plan = IngestPlan(kind="images", source=source.name, listing_sha256=listing.sha256, count=count,
                      num_shards=listing.num_shards, class_names=source.class_names,
                      settings={"prefix": settings.prefix, "samples_per_shard": size, "seed": settings.seed,
                                "max_side": settings.max_side})

    def make_job(number: int) -> ShardJob:
        return ShardJob(str(target.directory), settings.prefix, number, number * size, listing.shard_images(number),
                        settings.max_side, settings.on_bad_image)

    return run_ingest(target, plan, part, make_job, write_shard, weight=lambda n: min(size, count - n * size),
                      unit="img", workers=settings.workers, progress=progress,
                      shard_names=lambda n: shard_name(settings.prefix, n))
