"""`instcls bench data` measures both loaders on the same shards, with and without multi-crop, and
reports their ratios; with --storage, what one rank asks of the store from disk, from S3 and
through a latency proxy."""

import json

import pytest

from trainer.cli import main

# --storage starts an S3 server of its own or reads the tests' one: one at a time (see tests/conftest.py).
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("s3")]


def test_bench_data_reports_both_loaders_with_and_without_multicrop(digits_shards, tmp_path, capsys):
    args = f"bench data --shards {digits_shards} --crop-size 32 --batch 32 --batches 3 --warmup 1"
    assert main(args.split() + ["--json", str(tmp_path / "data.json")]) == 0
    summary = json.loads((tmp_path / "data.json").read_text())
    rows = {row["views"]: row for row in summary["recipes"]}
    assert list(rows) == ["2 x 32px", "2 x 32px + 6 x 13px"], summary
    for row in rows.values():
        assert row["dali_images_per_s"] > 0 and row["torch_images_per_s"] > 0
        assert row["dali_over_torch"] == pytest.approx(row["dali_images_per_s"] / row["torch_images_per_s"])
    # A row per recipe with both loaders' images/s and their ratio, then multi-crop over the plain
    # recipe (the one test of format_report's text).
    out = capsys.readouterr().out.splitlines()
    for views, row in rows.items():
        figures = [f"{row['dali_images_per_s']:.1f}", f"{row['torch_images_per_s']:.1f}",
                   f"{row['dali_over_torch']:.2f}x"]
        assert figures in [line[len(views):].split() for line in out if line.startswith(views + " ")], views
    plain, multicrop = rows.values()
    assert [line for line in out if f"{multicrop['dali_images_per_s'] / plain['dali_images_per_s']:.2f}x" in line
            and f"{multicrop['torch_images_per_s'] / plain['torch_images_per_s']:.2f}x" in line]


@pytest.mark.slow
def test_bench_data_storage_compares_disk_s3_and_s3_behind_added_latency(digits_shards, tmp_path, capsys):
    """One command: a local SeaweedFS with the set uploaded, read from disk, by both clients, and
    through the proxy at 0 and 30 ms; every request waits the delay, and the printed ratio is the
    rates'."""
    args = (f"bench data --storage --local-s3 --shards {digits_shards} --crop-size 32 --batch 32 --read-steps 6 "
            "--read-warmup 2 --decode-batches 2 --latency-rounds 1")
    assert main(args.split() + ["--json", str(tmp_path / "storage.json")]) == 0
    summary = json.loads((tmp_path / "storage.json").read_text())
    rows = {row["source"]: row for row in summary["sources"]}
    assert list(rows) == ["disk", "s3 boto3", "s3 s3torchconnector", "s3 boto3 +0 ms", "s3 boto3 +30 ms"]
    for row in rows.values():
        assert row["read_samples_per_s"] > 0 and row["decoded_images_per_s"] > 0 and row["errors"] == 0
        assert row["requests_per_sample"] == 1.0  # one ranged GET (or pread) per image, labels from the table
    assert rows["disk"]["opens_in_pass"] >= 1 and rows["s3 boto3"]["opens_in_pass"] == 0
    assert rows["s3 boto3 +30 ms"]["p50_ms"] >= 30 > rows["disk"]["p50_ms"]
    assert rows["s3 boto3"]["peak_in_flight"] > 1  # a step's GETs go out together
    latency = summary["latency"]
    assert latency["ratio"] == pytest.approx(rows["s3 boto3 +30 ms"]["read_samples_per_s"]
                                             / rows["s3 boto3 +0 ms"]["read_samples_per_s"])
    assert summary["clients"]["faster_per_cpu_s"] in ("boto3", "s3torchconnector")
    assert summary["demand"]["mean_image_bytes"] == pytest.approx(
        summary["demand"]["mb_per_s"] * 1e6 / summary["demand"]["images_per_s"])
    out = capsys.readouterr().out
    assert f"with 0 ms: {latency['ratio']:.2f} (goal >= 0.80" in out
    assert "ImageNet-21K (14,197,122 images)" in out


@pytest.mark.slow
def test_bench_data_storage_reads_an_s3_url_at_the_endpoint_the_environment_names(
        s3_server, digits_shards, monkeypatch, tmp_path):
    """--shards s3://... with AWS_ENDPOINT_URL_S3 and keys from the environment: no disk row, both
    clients, and the proxied rows in front of that endpoint."""
    url = "s3://instcls-bench-env/digits"
    s3_server.sync_up(digits_shards, url)
    for name, value in s3_server.client_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("INSTCLS_TABLE_CACHE", str(tmp_path / "tables"))
    args = (f"bench data --storage --shards {url} --batch 32 --read-steps 3 --read-warmup 1 --decode-batches 0 "
            "--latency-rounds 1 --latency-ms 20")
    assert main(args.split() + ["--json", str(tmp_path / "storage.json")]) == 0
    summary = json.loads((tmp_path / "storage.json").read_text())
    assert [row["source"] for row in summary["sources"]] == ["s3 boto3", "s3 s3torchconnector", "s3 boto3 +0 ms",
                                                            "s3 boto3 +20 ms"]
    assert all(row["decoded_images_per_s"] is None for row in summary["sources"])
    assert summary["sources"][-1]["p50_ms"] >= 20
