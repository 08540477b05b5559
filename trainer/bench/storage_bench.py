"""`instcls bench data --storage`: what one rank asks of its shard store, measured on the same set
from each source it can be read from, and what a whole job would ask.

Sources: the set on disk; on S3 read directly with each client (boto3 and s3torchconnector, the
same store); and, with the endpoint on plain http, through ``latency_proxy`` adding 0 ms and then
``latency_ms`` to every request.  ``--local-s3`` starts a SeaweedFS server and uploads the local set
(or the synthetic one) first, so one command gives all of them; ``--shards s3://...`` reads the
endpoint from the environment and has no disk row.

Per source: samples/s read as bytes only (``step_reads``: the loaders' concurrency and read-ahead)
and decoded (the loader itself), requests/s, p50/p99 latency and peak requests in flight from
``read_stats()``, opens/s, and CPU per sample (the reading process's, plus the proxy's where it is
in the path, so that 0 ms and ``latency_ms`` pay for it alike).  Then: the read rate with the
delay over the rate without it (read-ahead and ``max_in_flight`` must hide the delay: at least
``storage_report.LATENCY_RATIO_GOAL``), which client reads more per CPU second, and the demand of ``ranks`` ranks
at ``images_per_s`` (``storage_demand``); ``storage_report`` sums them up and prints them."""

from __future__ import annotations

import importlib.util
import itertools
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from data_pipeline.loading.augment.augment_config import AugmentConfig
from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.loader_config import LoaderConfig
from data_pipeline.shardset.sample_table import SampleTable, forget_tables
from data_pipeline.storage.shard_url import S3Url, shard_location
from data_pipeline.storage.storage_settings import S3_CLIENTS, StorageSettings, storage_settings, use_storage_settings
from data_pipeline.storage.stores import forget_stores
from trainer.bench.data_bench import synthetic_shards
from trainer.bench.settings.data import DataBenchSettings
from trainer.bench.step_reads import ReadFigures, measure_reads
from trainer.bench.storage_report import format_report, source_row, summarise

__all__ = ["format_report", "run"]

LOCAL_BUCKET = "instcls-bench"


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _fresh_stores(storage: StorageSettings) -> None:
    """The next table and loader open their store anew with ``storage`` (a proxied source has the
    direct one's URL)."""
    use_storage_settings(storage)
    forget_stores()
    forget_tables()


def decode_backend() -> str:
    """The loader whose decoded images/s is reported: DALI where it is installed, else the fallback."""
    return "dali" if importlib.util.find_spec("nvidia.dali") is not None else "torch"


def _decoded_images_per_s(location, settings: DataBenchSettings, device: torch.device) -> float | None:
    """Images/s through the loader over ``decode_batches`` batches after one untimed batch.  Every
    pass runs to its epoch's end (it starts that many steps before it): a pass left half-way would
    leave its reads ahead running against the store while the next source is measured."""
    if not settings.decode_batches:
        return None
    config = LoaderConfig(batch_size=settings.batch, backend=decode_backend(), num_threads=settings.threads,
                          augment=AugmentConfig(image_size=settings.crop_size, num_views=settings.views))
    loader = build_loader(location, config, rank=0, world_size=1, device=device, train=True)
    warmup, remaining, images, started = 1, 1 + settings.decode_batches, 0, None
    for epoch in itertools.count():
        take = min(remaining, loader.steps_per_epoch)
        for batch in loader.epoch_batches(epoch, start_step=loader.steps_per_epoch - take):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if warmup:
                warmup -= 1
                started = time.perf_counter()
                continue
            images += batch.instance_ids.shape[0]
        remaining -= take
        if not remaining:
            return images / (time.perf_counter() - started)


def _reads(location, storage: StorageSettings, settings: DataBenchSettings, extra_cpu_seconds=lambda: 0.0):
    _fresh_stores(storage)
    return measure_reads(SampleTable(location), settings.batch, settings.threads, settings.read_warmup,
                         settings.read_steps, extra_cpu_seconds, settings.read_ahead_threads)


def _row(name: str, location, reads: ReadFigures, storage: StorageSettings, settings: DataBenchSettings,
         device: torch.device, client: str | None = None, delay_ms: float | None = None,
         rounds: list[float] | None = None) -> dict:
    """``reads`` with the decoded images/s measured now, under ``storage``."""
    _fresh_stores(storage)
    decoded = _decoded_images_per_s(location, settings, device)
    print(f"  {name}: {reads.samples_per_s:,.1f} samples/s read"
          + (f", {decoded:,.1f} images/s decoded" if decoded is not None else ""), flush=True)
    return source_row(name, location, reads, decoded, client, delay_ms, settings.images_per_s, rounds)


def _proxy_refusal(endpoint: str | None) -> str | None:
    """Why the proxied sources cannot be measured at ``endpoint``, or None."""
    if endpoint is None:
        return "no proxied rows: the endpoint is AWS itself (set AWS_ENDPOINT_URL_S3 to an http:// store)"
    if not endpoint.startswith("http://"):
        return f"no proxied rows: {endpoint} is not plain http://, and the proxy cannot see requests inside TLS"
    return None


def _s3_rows(url: S3Url, settings: DataBenchSettings, base: StorageSettings, device: torch.device) -> tuple[list, str]:
    """Each client straight to the store, then the configured one through the proxy at 0 ms and at
    ``latency_ms``: ``latency_rounds`` alternating reads of each (a burst of load on a shared machine
    then lands on both), the round with the median rate standing for each."""
    from trainer.bench.latency_proxy import LatencyProxy

    rows = []
    for client in (settings.client, *[c for c in S3_CLIENTS if c != settings.client]):
        storage = replace(base, client=client)
        rows.append(_row(f"s3 {client}", url, _reads(url, storage, settings), storage, settings, device, client))
    refusal = _proxy_refusal(base.resolved_endpoint)
    if refusal is not None:
        return rows, refusal
    delays = (0.0, settings.latency_ms)
    with ExitStack() as stack:
        proxies = [stack.enter_context(LatencyProxy(base.resolved_endpoint, delay_ms)) for delay_ms in delays]
        rounds: list[list[ReadFigures]] = [[], []]
        connections = [0, 0]
        for _ in range(settings.latency_rounds):
            for index, proxy in enumerate(proxies):
                rounds[index].append(_reads(url, replace(base, endpoint_url=proxy.endpoint), settings,
                                            proxy.cpu_seconds))
                connections[index] = max(connections[index], proxy.client_connections())
        for proxy, delay_ms, measured, opened in zip(proxies, delays, rounds, connections):
            median = sorted(measured, key=lambda reads: reads.samples_per_s)[len(measured) // 2]
            storage = replace(base, endpoint_url=proxy.endpoint)
            row = _row(f"s3 {settings.client} +{delay_ms:g} ms", url, median, storage, settings, device,
                       settings.client, delay_ms, rounds=[reads.samples_per_s for reads in measured])
            rows.append(dict(row, connections=opened))
    return rows, None


def run(settings: DataBenchSettings) -> dict:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    previous = storage_settings()
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        stack.callback(_fresh_stores, previous)
        location = shard_location(settings.shards) if settings.shards else None
        if location is None:
            print(f"writing {settings.synthetic_count} synthetic {settings.image_size}px images", flush=True)
            location = synthetic_shards(tmp / "synthetic", settings.synthetic_count, settings.image_size)
        base = StorageSettings(client=settings.client, max_in_flight=settings.max_in_flight,
                               table_cache_dir=str(tmp / "tables") if settings.local_s3 else None)
        local, remote = (None, location) if isinstance(location, S3Url) else (location, None)
        if settings.local_s3:
            remote = _start_local_s3(local, tmp, stack)
        rows, refusal = [], None
        if local is not None:
            rows.append(_row("disk", local, _reads(local, base, settings), base, settings, device))
        if remote is not None:
            s3_rows, refusal = _s3_rows(remote, settings, base, device)
            rows += s3_rows
        _fresh_stores(base)
        table = SampleTable(remote if local is None else local)
        mean_bytes, images = float(table.rows["size"].mean()), table.num_samples
    return summarise(settings, rows, mean_bytes, images, device.type, refusal,
                     decode_backend() if settings.decode_batches else None)


def _start_local_s3(local: Path, tmp: Path, stack: ExitStack) -> S3Url:
    """A SeaweedFS server for this run, with the set uploaded and this process's env pointing at it."""
    from trainer.bench.seaweed_server import SeaweedServer

    print("starting a local SeaweedFS and uploading the set", flush=True)
    server = SeaweedServer(tmp / "seaweedfs", signed=True).start()
    stack.callback(server.stop)
    stack.enter_context(_environment(server.client_env()))
    url = S3Url(f"s3://{LOCAL_BUCKET}/{Path(local).resolve().name or 'set'}")
    server.sync_up(local, url)
    return url
