"""`instcls bench data --storage`'s figures without a store: the job's demand from one rank's
reads, the latency ratio and the clients' comparison, the printed table, and one rank's reads of a
local set counted as the loaders make them."""

import pytest

from trainer.bench.settings.data import DataBenchSettings
from trainer.bench.step_reads import READ_AHEAD, ReadFigures, measure_reads
from trainer.bench.storage_demand import StoreDemand
from trainer.bench.storage_report import format_report, source_row, summarise


def test_the_demand_of_a_job_is_its_images_per_second_times_each_images_requests_and_bytes():
    # 4 ranks x 250 images/s = 1,000 images/s; 1.5 requests and 20,000 bytes each: 1,500
    # requests/s and 20 MB/s; 3M images take 3,000 s and hold 0.06 TB.
    demand = StoreDemand(ranks=4, images_per_s_per_rank=250.0, requests_per_sample=1.5, mean_image_bytes=20_000)
    assert demand.images_per_s == 1000.0
    assert demand.requests_per_s == 1500.0
    assert demand.mb_per_s == pytest.approx(20.0)
    summary = demand.summary(3_000_000)
    assert summary["epoch_seconds"] == pytest.approx(3000.0)
    assert summary["epoch_requests"] == pytest.approx(4_500_000)
    assert summary["epoch_terabytes"] == pytest.approx(0.06)


def _reads(samples_per_s: float, cpu_ms_per_sample: float, p50_ms: float = 1.0, requests_per_sample=1.0):
    samples, seconds = 640, 640 / samples_per_s
    return ReadFigures(samples=samples, seconds=seconds, cpu_seconds=samples * cpu_ms_per_sample / 1e3,
                       requests=samples, bytes=samples * 10_000, opens=0, opens_in_pass=2,
                       requests_per_sample=requests_per_sample, errors=0, retries=0, p50_ms=p50_ms, p99_ms=2 * p50_ms,
                       peak_in_flight=64, read_threads=64)


def _summary(settings, zero_ms_rate: float, delayed_rate: float) -> dict:
    rows = [
        source_row("disk", "/set", _reads(5000.0, 0.2), 150.0, None, None, settings.images_per_s),
        source_row("s3 boto3", "s3://b/set", _reads(400.0, 2.0, requests_per_sample=1.0), 120.0, "boto3", None,
                   settings.images_per_s),
        source_row("s3 s3torchconnector", "s3://b/set", _reads(500.0, 0.5), 130.0, "s3torchconnector", None,
                   settings.images_per_s),
        dict(source_row("s3 boto3 +0 ms", "s3://b/set", _reads(zero_ms_rate, 2.2), None, "boto3", 0.0,
                        settings.images_per_s, rounds=[zero_ms_rate - 10, zero_ms_rate, zero_ms_rate + 5]),
             connections=64),
        dict(source_row("s3 boto3 +30 ms", "s3://b/set", _reads(delayed_rate, 2.2, p50_ms=40.0), None, "boto3", 30.0,
                        settings.images_per_s, rounds=[delayed_rate, delayed_rate + 1, delayed_rate - 1]),
             connections=64),
    ]
    return summarise(settings, rows, mean_image_bytes=9_900.0, set_images=2048, device="cpu")


def test_the_summary_compares_the_delayed_read_rate_and_the_clients_and_figures_the_job():
    settings = DataBenchSettings(storage=True)
    summary = _summary(settings, zero_ms_rate=400.0, delayed_rate=340.0)
    assert summary["latency"]["ratio"] == pytest.approx(340.0 / 400.0)
    assert summary["latency"]["holds"]  # 0.85 >= 0.8
    assert not _summary(settings, zero_ms_rate=400.0, delayed_rate=300.0)["latency"]["holds"]  # 0.75
    clients = summary["clients"]
    # boto3: 1 / 2 ms = 500 samples per CPU second; s3torchconnector: 1 / 0.5 ms = 2,000.
    assert clients["boto3"]["samples_per_cpu_s"] == pytest.approx(500.0)
    assert clients["faster_per_cpu_s"] == "s3torchconnector"
    assert clients["per_cpu_s_ratio"] == pytest.approx(4.0)
    # The demand reads requests per sample from the configured client's direct row.
    assert summary["demand_reference"] == "s3 boto3"
    assert summary["demand"]["images_per_s"] == pytest.approx(64 * settings.images_per_s)
    assert summary["demand"]["mean_image_bytes"] == 9_900.0
    assert summary["demand_at_assumed_size"]["mean_image_bytes"] == 110_000


def test_the_report_prints_a_row_per_source_then_the_ratio_the_clients_and_the_demand():
    settings = DataBenchSettings(storage=True)
    summary = _summary(settings, zero_ms_rate=400.0, delayed_rate=300.0)
    lines = format_report(settings, summary).splitlines()
    rows = {line[:26].strip(): line[26:].split() for line in lines[2:7]}
    assert list(rows) == ["disk", "s3 boto3", "s3 s3torchconnector", "s3 boto3 +0 ms", "s3 boto3 +30 ms"]
    # read/s, decoded/s, req/s, p50, p99, in flight, opens/s, CPU ms/sample, MB/s, x need
    assert rows["s3 boto3 +30 ms"] == ["300.0", "-", "300.0", "40.00", "80.00", "64", "0.0", "2.200", "3.0",
                                       f"{300.0 / settings.images_per_s:.2f}x"]
    text = "\n".join(lines)
    assert "with 0 ms: 0.75 (goal >= 0.80: MISSED)" in text
    assert "rounds: 30 ms 300/301/299, 0 ms 390/400/405 samples/s" in text
    assert "s3torchconnector reads 4.00x as many samples per CPU second" in text
    assert "64 ranks x 858.6 images/s (docs/gpu-results.md's ResNet-50 step on one H200) = 54,950 images/s" in text
    assert "54,950 requests/s" in text and "544 MB/s at this set's mean 9.9 KB" in text
    assert "6,045 MB/s at ImageNet's ~110.0 KB (assumed)" in text
    assert "ImageNet-21K (14,197,122 images)" in text


@pytest.mark.parametrize("read_ahead_threads", [1, 3])
def test_one_ranks_reads_of_a_local_set_are_one_pread_per_sample_and_one_open_per_shard(digits_shards,
                                                                                       read_ahead_threads):
    from data_pipeline.shardset.sample_table import SampleTable
    from data_pipeline.storage.stores import forget_stores

    forget_stores()  # a fresh store: every shard it touches is opened in this pass
    table = SampleTable(digits_shards)
    reads = measure_reads(table, batch=32, threads=2, warmup=1, steps=4, read_ahead_threads=read_ahead_threads)
    assert reads.samples == 4 * 32
    assert reads.requests_per_sample == 1.0
    assert reads.read_threads == 2 and 1 <= reads.peak_in_flight <= 2  # overlapping steps share the 2 threads
    # A shard is opened once, or by each thread that raced to open it first (one handle is kept).
    assert 1 <= reads.opens_in_pass <= len(table.shards) * reads.read_threads
    assert reads.opens == 0  # the warm-up step opened what the timed ones read: handles are kept


def test_the_bench_reads_as_many_steps_ahead_as_the_dali_source():
    dali_loader = pytest.importorskip("data_pipeline.loading.dali_loader")
    assert READ_AHEAD == dali_loader.READ_AHEAD
