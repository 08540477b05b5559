"""`instcls bench data`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from data_pipeline.storage.shard_url import shard_location
from data_pipeline.storage.storage_settings import StorageSettings

# docs/gpu-results.md section 4: ResNet-50 + the chunked sharded classifier, CO2 off (the shipped
# in21k_r50_64gpu.yaml's step), bf16, 64 images x 2 views per step on one H200, torchvision loader.
GPU_STEP_IMAGES_PER_S = 858.6


@dataclass(frozen=True)
class DataBenchSettings:
    """Attributes:
    shards: a shard set: a directory, or s3://BUCKET/PREFIX with the endpoint, region and keys from
        AWS_ENDPOINT_URL_S3, AWS_REGION, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (default:
        synthetic shards written to a temporary directory).
    synthetic_count: images in the synthetic shards.
    image_size: side of the synthetic images on disk.
    crop_size: side of the global views.
    views: global views per image.
    small_crops: small views per image in the configured recipe.
    batch: images per batch.
    threads: DALI threads = DataLoader workers (with --storage: a local set's read threads and DALI's).
    batches: timed batches.
    warmup: untimed batches.
    multicrop: small views of the multi-crop recipe measured next to the configured views (0: only
        the configured views).
    storage: instead of the two loaders: what one rank asks of the shard store (samples/s read as
        bytes only and decoded, requests/s, latency, requests in flight, opens), and what --ranks
        ranks at --images-per-s would ask.
    local_s3: --storage with a local SeaweedFS (weed mini, a test extra) started for the run: the set
        is uploaded to it and measured from disk, from S3 with both clients, and through a latency
        proxy adding 0 ms, then --latency-ms, to every request.
    latency_ms: delay the proxy adds to each request in the second proxied measurement.
    latency_rounds: reads through the proxy at 0 ms and at --latency-ms, alternating; each row shows
        its median round.
    client: the S3 client of the proxied measurements (both are measured directly).
    max_in_flight: ranged GETs one process keeps in flight (data.storage.max_in_flight).
    read_steps: timed steps read as bytes only, per source.
    read_ahead_threads: threads reading the 3 steps ahead: 3, as DALI's source reads them (their round
        trips overlap, sharing the step's read concurrency); 1 reads them one after another.
    read_warmup: untimed steps read first, per source.
    decode_batches: timed batches through the DALI loader (the torch one without DALI), per source;
        0: no decoded figure.
    ranks: ranks of the job whose demand on the store is figured.
    images_per_s: images/s of one rank in that job (default: a ResNet-50 training step on one
        H200, docs/gpu-results.md section 4).
    """

    shards: str | None = None
    synthetic_count: int = 2048
    image_size: int = 224
    crop_size: int = 224
    views: int = 2
    small_crops: int = 0
    batch: int = 64
    threads: int = 2
    batches: int = 20
    warmup: int = 2
    multicrop: int = 6
    storage: bool = False
    local_s3: bool = False
    latency_ms: float = 30.0
    latency_rounds: int = 3
    client: Literal["boto3", "s3torchconnector"] = "boto3"
    max_in_flight: int = StorageSettings().max_in_flight
    read_steps: int = 20
    read_ahead_threads: int = 3
    read_warmup: int = 3
    decode_batches: int = 20
    ranks: int = 64
    images_per_s: float = GPU_STEP_IMAGES_PER_S

    def __post_init__(self) -> None:
        if self.shards is not None:
            shard_location(self.shards)  # refuses other URL schemes, naming the two forms
        if self.local_s3 and self.shards is not None and self.shards.startswith("s3://"):
            raise ValueError(f"--local-s3 uploads a local set; --shards {self.shards} is on S3 already: drop "
                             "--local-s3, or give a directory")
        for name in ("read_steps", "ranks", "max_in_flight", "batch", "latency_rounds", "read_ahead_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: use at least 1")
        for name in ("read_warmup", "decode_batches", "latency_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: use 0 or more")
        if self.images_per_s <= 0:
            raise ValueError(f"--images-per-s {self.images_per_s}: use a positive rate")

    @property
    def measures_storage(self) -> bool:
        return self.storage or self.local_s3
