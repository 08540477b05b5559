"""A shard set read from a real S3 server (SeaweedFS) is the same set as on disk, and every way
the store can fail is a clear error within seconds, never a hang."""

import time

import numpy as np
import pytest

from data_pipeline.shardset.sample_table import SampleTable, ShardReadError
from data_pipeline.shardset.set_files import manifest_sha256
from data_pipeline.storage.read_stats import read_stats
from data_pipeline.storage.storage_errors import BucketNotFoundError, StorageAccessError, StorageUnavailableError
from data_pipeline.storage.storage_settings import StorageSettings, use_storage_settings
from data_pipeline.storage.stores import forget_stores, open_store

pytestmark = pytest.mark.xdist_group("s3")

QUICK = dict(connect_timeout_s=1.0, read_timeout_s=2.0, outage_retry_s=2.0)


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path):
    for name, value in s3_server.client_env().items():
        monkeypatch.setenv(name, value)
    use_storage_settings(StorageSettings(table_cache_dir=str(tmp_path / "tables"), **QUICK))
    forget_stores()
    yield s3_server
    use_storage_settings(StorageSettings())
    forget_stores()


@pytest.fixture(scope="module")
def colors_on_s3(s3_server, color_shards):
    url = "s3://instcls-reads/sets/colors"
    s3_server.sync_up(color_shards, url)
    return url


def test_an_s3_set_reads_the_same_bytes_labels_and_digest_as_on_disk(s3_env, color_shards, colors_on_s3, tmp_path):
    local, remote = SampleTable(color_shards), SampleTable(colors_on_s3)
    assert remote.num_samples == local.num_samples
    ids = np.arange(local.num_samples)
    expected = [local.read_jpeg(i) for i in ids]
    before = read_stats().snapshot()
    assert [remote.read_jpeg(i) for i in ids] == expected
    assert read_stats().snapshot().since(before).requests == local.num_samples  # one ranged GET per image
    assert remote.labels(ids).tolist() == local.labels(ids).tolist()
    assert manifest_sha256(colors_on_s3) == manifest_sha256(color_shards)
    assert remote.describe(3) == local.describe(3)  # the same shard and key in errors
    cached = list((tmp_path / "tables").glob("*.npy"))
    assert len(cached) == 1  # downloaded once per node, named by its digest
    SampleTable(colors_on_s3)
    assert list((tmp_path / "tables").glob("*.npy")) == cached


def test_a_wrong_endpoint_fails_within_its_connect_bound(s3_env, colors_on_s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # discard port: refused
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError, match=r"127\.0\.0\.1:9.*endpoint_url"):
        SampleTable(colors_on_s3)
    assert time.monotonic() - started < 10


def test_refused_and_missing_credentials_name_the_fix(s3_env, colors_on_s3, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(StorageAccessError, match=r"s3://instcls-reads/sets/colors/manifest.json.*AWS_ACCESS_KEY_ID"):
        SampleTable(colors_on_s3)
    forget_stores()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageAccessError, match="no S3 credentials were found.*unsigned"):
        SampleTable(colors_on_s3)


def test_a_missing_bucket_or_prefix_is_named(s3_env, colors_on_s3):
    with pytest.raises(BucketNotFoundError, match="s3://no-such-bucket/x.*does not exist"):
        SampleTable("s3://no-such-bucket/x")
    with pytest.raises(FileNotFoundError, match="s3://instcls-reads/sets/nothing/manifest.json not found.*make-shards"):
        SampleTable("s3://instcls-reads/sets/nothing")


def test_a_table_that_does_not_match_its_digest_is_refused(s3_env, s3_server, color_shards):
    url = "s3://instcls-reads/sets/bad-table"
    s3_server.sync_up(color_shards, url)
    client = s3_server.client()
    key = "sets/bad-table/samples.npy"
    table = client.get_object(Bucket="instcls-reads", Key=key)["Body"].read()
    client.put_object(Bucket="instcls-reads", Key=key, Body=table[:-20] + bytes(20))
    with pytest.raises(ValueError, match="samples.npy: its SHA-256 is .*the manifest says"):
        SampleTable(url)


def test_a_tar_shorter_than_its_index_is_named(s3_env, s3_server, color_shards):
    url = "s3://instcls-reads/sets/short-tar"
    s3_server.sync_up(color_shards, url)
    local = SampleTable(color_shards)
    tar = local.shards[0].tar
    client = s3_server.client()
    body = client.get_object(Bucket="instcls-reads", Key=f"sets/short-tar/{tar}")["Body"].read()
    client.put_object(Bucket="instcls-reads", Key=f"sets/short-tar/{tar}", Body=body[:2048])
    remote = SampleTable(url)
    last_of_first_shard = local.shards[0].count - 1
    with pytest.raises(ShardReadError, match=rf"{tar} key .*needs \d+ bytes at offset \d+.*truncated"):
        remote.read_jpeg(last_of_first_shard)


def test_a_store_that_stops_mid_epoch_is_retried_then_stops_the_run(s3_env, s3_server, colors_on_s3):
    remote = SampleTable(colors_on_s3)
    remote.read_jpeg(0)
    before = read_stats().snapshot()
    s3_server.pause()
    try:
        started = time.monotonic()
        outage = r"no answer after retrying for [\d.]+ s \(data\.storage\.outage_retry_s=2;.*resumes"
        with pytest.raises(StorageUnavailableError, match=outage):
            remote.read_jpeg(1)
        took = time.monotonic() - started
    finally:
        s3_server.resume()
    assert 2 <= took < 2 + QUICK["read_timeout_s"] + 3
    assert read_stats().snapshot().since(before).retries >= 1
    assert remote.read_jpeg(1) == SampleTable(colors_on_s3).read_jpeg(1)  # back: the same reader reads again


def test_anonymous_reads_from_an_open_server_and_refused_by_a_signing_one(s3_env, s3_server, colors_on_s3,
                                                                          color_shards, tmp_path, monkeypatch):
    """A server started without keys serves unsigned requests; one started with keys answers them 403."""
    from tests.helpers.s3_server import SeaweedServer

    use_storage_settings(StorageSettings(unsigned=True, table_cache_dir=str(tmp_path / "tables"), **QUICK))
    forget_stores()
    with pytest.raises(StorageAccessError, match="refused the request's credentials"):
        SampleTable(colors_on_s3)
    open_server = SeaweedServer(tmp_path / "anonymous", signed=False).start()
    try:
        open_server.sync_up(color_shards, "s3://public-sets/colors")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", open_server.endpoint)
        forget_stores()
        remote = SampleTable("s3://public-sets/colors")
        assert remote.read_jpeg(7) == SampleTable(color_shards).read_jpeg(7)
    finally:
        open_server.stop()


def test_the_command_line_exits_1_for_an_unreachable_store_and_2_for_a_missing_set(s3_env, colors_on_s3, capsys):
    """exit 1 (the Job's counted retry) when the store does not answer; exit 2 when the input is wrong."""
    from trainer.cli import main

    common = ["plan", "--config", "configs/digits_cpu.yaml", "--ranks", "2"]
    endpoint = "data.storage.endpoint_url=http://127.0.0.1:9"
    quick = "data.storage.connect_timeout_s=1"
    assert main([*common, "--set", f"data.train_shards={colors_on_s3}", "--set", endpoint, "--set", quick]) == 1
    printed = capsys.readouterr().err.strip().splitlines()
    assert printed[-1].startswith("instcls: error: s3://instcls-reads/sets/colors/manifest.json: cannot read at "
                                  "http://127.0.0.1:9"), printed
    assert main([*common, "--set", "data.train_shards=s3://instcls-reads/sets/none"]) == 2
    assert "data.train_shards=s3://instcls-reads/sets/none has no manifest.json" in capsys.readouterr().err


def test_tars_indexed_in_place_resolve_under_the_prefix_as_on_disk(s3_env, s3_server, color_shards, tmp_path):
    """A set whose manifest names ``../tars/x.tar``: copied with the tars' folder beside it, it reads
    the same from the bucket, and a path that would leave the bucket is refused."""
    import shutil

    from data_pipeline.ingest.tars_in_place import index_tars
    from data_pipeline.storage.shard_url import S3Url

    root = tmp_path / "wds"
    (root / "tars").mkdir(parents=True)
    for tar in sorted(color_shards.glob("*.tar"))[:2]:
        shutil.copy(tar, root / "tars" / tar.name)
    index_tars(root / "tars", root / "index", labels=True, workers=1, progress=False)
    local = SampleTable(root / "index")
    assert local.shards[0].tar.startswith("../tars/")
    s3_server.sync_up(root, "s3://instcls-reads/wds")
    remote = SampleTable("s3://instcls-reads/wds/index")
    ids = range(local.num_samples)
    assert [remote.read_jpeg(i) for i in ids] == [local.read_jpeg(i) for i in ids]
    assert remote.labels(np.arange(local.num_samples)).tolist() == local.labels(np.arange(local.num_samples)).tolist()
    with pytest.raises(ValueError, match="resolves outside the bucket"):
        S3Url("s3://instcls-reads/wds/index").key("../../../x.tar")


def test_a_store_that_resets_every_connection_is_retried_as_an_outage(s3_env, monkeypatch):
    """Connections closed under the request (a restarting store, a proxy dropping them) are the
    network's fault: retried with backoff and counted, then the run stops with exit 1's error."""
    import socket
    import struct
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def reset_every_connection():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
            conn.recv(1024)
            conn.close()

    threading.Thread(target=reset_every_connection, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{listener.getsockname()[1]}")
    before = read_stats().snapshot()
    try:
        with pytest.raises(StorageUnavailableError, match="no answer after retrying"):
            SampleTable("s3://instcls-reads/sets/colors")
    finally:
        listener.close()
    assert read_stats().snapshot().since(before).retries >= 2


def test_with_skip_a_refused_credential_stops_the_run_instead_of_blanking_samples(s3_env, colors_on_s3,
                                                                                  monkeypatch):
    """on_bad_sample: skip is for damaged samples; keys rotated mid-run would otherwise blank them all."""
    from data_pipeline.loading.sample_reader import StepReader
    from data_pipeline.loading.samplers.epoch_permutation import EpochPermutationSampler

    table = SampleTable(colors_on_s3)
    reader = StepReader(table, EpochPermutationSampler(table.num_samples, 1, 5, 0), rank=0, seed=0, augment=None,
                        skip_bad_samples=True)
    assert not reader.read(0, 0).samples.skipped
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rotated")
    forget_stores()
    table.store = open_store(colors_on_s3)  # a client made with the rotated key, as a restarted rank would
    with pytest.raises(StorageAccessError, match="refused the request's credentials"):
        reader.read(0, 1)
