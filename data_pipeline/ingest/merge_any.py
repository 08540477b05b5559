"""`instcls merge-shards OUT`: the merge of a directory (``shard_merge``) or of an ``s3://`` prefix
(``s3_merge``: merged in a local staging directory and uploaded, the manifest last)."""

from __future__ import annotations

from pathlib import Path

from data_pipeline.ingest.s3_merge import merge_on_s3
from data_pipeline.ingest.shard_merge import merge_shards
from data_pipeline.shardset.manifest import ShardManifest
from data_pipeline.storage.shard_url import S3Url, shard_location


def merge_shard_set(out: Path | str, wait_seconds: float = 0.0, poll_seconds: float = 10.0,
                    staging: Path | None = None) -> ShardManifest:
    location = shard_location(out)
    if isinstance(location, S3Url):
        return merge_on_s3(location, staging, wait_seconds, poll_seconds)
    if staging is not None:
        raise ValueError(f"--staging {staging}: only a set on s3:// is merged in a staging directory; {location} is "
                         "merged where it is (leave --staging out)")
    return merge_shards(location, wait_seconds, poll_seconds)
