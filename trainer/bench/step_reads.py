"""One rank's reads of a shard set, bytes only, as the loaders issue them: ``StepReader`` reads each
step's samples on the store's concurrency (``data.storage.max_in_flight`` ranged GETs on ``s3://``,
the loader's ``num_threads`` on a local set) and parses each image's header, never its pixels; one
background thread keeps ``READ_AHEAD`` steps submitted ahead of the one handed out, as DALI's
source does.  What the store was asked meanwhile comes from ``read_stats()``."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from data_pipeline.loading.augment.augment_config import AugmentConfig
from data_pipeline.loading.base_loader import default_sampler
from data_pipeline.loading.loader_config import LoaderConfig
from data_pipeline.loading.sample_reader import StepInputs, StepReader
from data_pipeline.shardset.sample_table import SampleTable
from data_pipeline.storage.read_stats import read_stats

# data_pipeline.loading.dali_loader.READ_AHEAD (that module imports DALI; a test holds the two equal).
READ_AHEAD = 3


@dataclass(frozen=True)
class ReadFigures:
    """One rank's bytes-only reads over the timed steps."""

    samples: int
    seconds: float
    cpu_seconds: float  # the reading process's, plus a latency proxy's when one is in the path
    requests: int
    bytes: int
    opens: int
    opens_in_pass: int  # from the first warm-up step: a fresh local store opens each shard it touches once
    requests_per_sample: float  # over every step read, warm-up and read-ahead included
    errors: int
    retries: int
    p50_ms: float
    p99_ms: float
    peak_in_flight: int
    read_threads: int

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def opens_per_s(self) -> float:
        return self.opens / self.seconds

    @property
    def samples_per_cpu_s(self) -> float:
        return self.samples / self.cpu_seconds if self.cpu_seconds > 0 else float("inf")


def steps_in_order(steps_per_epoch: int) -> Iterator[tuple[int, int]]:
    """``(epoch, step)`` from step 0 of epoch 0 on, through as many epochs as asked for."""
    for epoch in itertools.count():
        for step in range(steps_per_epoch):
            yield epoch, step


class ReadAhead:
    """Steps in order, read by ``threads`` background threads that keep ``depth`` steps submitted
    beyond the one handed out (``_StepSource`` in ``dali_loader`` has one thread per step ahead, so
    their round trips overlap, sharing the reader's concurrency; 1 reads them one after another)."""

    def __init__(self, reader: StepReader, depth: int = READ_AHEAD, threads: int = READ_AHEAD) -> None:
        self.reader, self.samples_read, self._lock = reader, 0, threading.Lock()
        self._positions = steps_in_order(reader.sampler.steps_per_epoch)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-read-ahead")
        self._pending: deque = deque(self._submit() for _ in range(depth))

    def _read(self, epoch: int, step: int) -> StepInputs:
        inputs = self.reader.read(epoch, step)
        with self._lock:
            self.samples_read += len(inputs.jpegs)
        return inputs

    def _submit(self):
        return self._pool.submit(self._read, *next(self._positions))

    def next(self) -> StepInputs:
        self._pending.append(self._submit())
        return self._pending.popleft().result()

    def close(self) -> None:
        """Wait for the steps being read, drop those not started: ``samples_read`` is then final."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def step_reader(table: SampleTable, batch: int, threads: int) -> StepReader:
    """Rank 0 of one, training order and views, with the loader's read concurrency."""
    config = LoaderConfig(batch_size=batch, num_threads=threads, augment=AugmentConfig())
    sampler = default_sampler(table.num_samples, config, world_size=1, train=True)
    return StepReader(table, sampler, rank=0, seed=config.sample_seed, augment=config.augment,
                      read_threads=threads)  # s3:// reads on the store's own pool


def measure_reads(table: SampleTable, batch: int, threads: int, warmup: int, steps: int,
                  extra_cpu_seconds=lambda: 0.0, read_ahead_threads: int = READ_AHEAD) -> ReadFigures:
    """Read ``warmup`` untimed steps, then time ``steps`` more, the read-ahead running throughout.
    ``extra_cpu_seconds()``: CPU spent elsewhere on these reads so far (a proxy's), counted with
    this process's.  Requests per sample are over every step read, so that the steps being read
    ahead at either end of the timed window do not count as requests without samples."""
    reader = step_reader(table, batch, threads)
    stats = read_stats()
    first = stats.snapshot()
    reads = ReadAhead(reader, threads=read_ahead_threads)
    try:
        for _ in range(warmup):
            reads.next()
        stats.reset_peak()
        before, cpu_before, extra_before = stats.snapshot(), time.process_time(), extra_cpu_seconds()
        started, samples = time.perf_counter(), 0
        for _ in range(steps):
            samples += len(reads.next().jpegs)
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu_before + extra_cpu_seconds() - extra_before
        window = stats.snapshot().since(before)
    finally:
        reads.close()
    whole = stats.snapshot().since(first)
    return ReadFigures(samples, seconds, cpu, window.requests, window.bytes, window.opens, whole.opens,
                       whole.requests / reads.samples_read, window.errors, window.retries, window.percentile_ms(50),
                       window.percentile_ms(99), window.peak_in_flight, reader.read_threads)
