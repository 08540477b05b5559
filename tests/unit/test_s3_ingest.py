"""make-shards, merge-shards and validate-shards on an s3:// prefix of a real S3 server (SeaweedFS):
the set written there is byte for byte the one the same ingest writes to disk, a killed ingest
resumes without rewriting what reached the bucket, and the store's errors name the URL and the fix."""

import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.ingest import make_shards
from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.sources.generated import Source, synthetic
from data_pipeline.shardset.set_files import load_manifest, manifest_sha256
from data_pipeline.storage.s3_store import S3Store
from data_pipeline.storage.storage_settings import StorageSettings, use_storage_settings
from data_pipeline.storage.stores import forget_stores
from trainer.cli import main

pytestmark = pytest.mark.xdist_group("s3")

BUCKET = "instcls-ingest"
QUICK = dict(connect_timeout_s=1.0, read_timeout_s=2.0, outage_retry_s=2.0)
SETTINGS = ShardSettings(prefix="syn", samples_per_shard=4, workers=1)
SYNTHETIC = ["--source", "synthetic", "--count", "30", "--image-size", "16", "--samples-per-shard", "4",
             "--no-progress"]


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path):
    for name, value in s3_server.client_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the default staging goes
    (tmp_path / "tmp").mkdir()
    use_storage_settings(StorageSettings(table_cache_dir=str(tmp_path / "tables"), **QUICK))
    forget_stores()
    client = s3_server.client()
    if BUCKET not in [bucket["Name"] for bucket in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket=BUCKET)
    yield s3_server
    use_storage_settings(StorageSettings())
    forget_stores()


class Uploads(list):
    """Every key the store uploads, in order; ``cut`` holds keys whose upload is killed (as a
    SIGKILL between two PUTs would), each once."""

    def __init__(self) -> None:
        super().__init__()
        self.cut: set[str] = set()


@pytest.fixture
def uploads(monkeypatch):
    seen, real = Uploads(), S3Store.upload

    def upload(store, path, relative):
        if relative in seen.cut:
            seen.cut.discard(relative)
            raise KeyboardInterrupt
        seen.append(relative)
        return real(store, path, relative)

    monkeypatch.setattr(S3Store, "upload", upload)
    return seen


def every_file(directory: Path) -> dict[str, bytes]:
    """Every file of a set, the ingest's records included, relative name -> bytes."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def copy_of(server, url: str, directory: Path) -> dict[str, bytes]:
    server.sync_down(url, directory)
    return every_file(directory)


@pytest.fixture(scope="module")
def source():
    return synthetic(30, 16, seed=4)


@pytest.fixture(scope="module")
def on_disk(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("on_disk")
    write_shards(source, out, SETTINGS, progress=False)
    return out


def test_make_shards_to_s3_writes_the_disk_set_and_validates(s3_env, tmp_path, capsys):
    disk, url = tmp_path / "disk", f"s3://{BUCKET}/sets/synthetic"
    assert main(["make-shards", *SYNTHETIC, "--workers", "2", "--out", str(disk)]) == 0
    staging = tmp_path / "staging"
    assert main(["make-shards", *SYNTHETIC, "--workers", "2", "--out", url, "--staging", str(staging)]) == 0
    assert f"wrote 30 instances in 8 shard(s) to {url}" in capsys.readouterr().out
    assert manifest_sha256(url) == manifest_sha256(disk), "the same manifest, so the same set's digest"
    assert copy_of(s3_env, url, tmp_path / "copy") == every_file(disk), "aws s3 sync gives back the disk set"
    assert not list(staging.rglob("*.tar")), "an uploaded shard leaves staging: it holds the records only"
    assert main(["validate-shards", url]) == 0
    assert f"checked 30 samples in {url}: all good" in capsys.readouterr().out
    # The hash check reads the tar through the store: a tar changed on S3 (same length) is found.
    manifest = load_manifest(url)
    key = f"sets/synthetic/{manifest.shards[3].tar}"
    client = s3_env.client()
    tar = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    tar[600] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(tar))
    assert main(["validate-shards", url]) == 1
    assert (f"PROBLEM {manifest.shards[3].tar}: sha256 differs from the manifest (file changed or truncated)"
            in capsys.readouterr().out)


def test_a_killed_s3_ingest_resumes_without_rewriting_what_reached_the_bucket(
        s3_env, source, on_disk, uploads, tmp_path, monkeypatch):
    url, staging = f"s3://{BUCKET}/sets/killed", tmp_path / "staging"
    written = []
    real_write = make_shards.write_shard
    monkeypatch.setattr(make_shards, "write_shard", lambda job: written.append(job.number) or real_write(job))

    # Killed between shard 2's files and its record: the bucket has shards 0 and 1 whole.
    uploads.cut.add(".ingest/000002.json")
    with pytest.raises(KeyboardInterrupt):
        write_shards(source, url, SETTINGS, progress=False, staging=staging)
    assert written == [0, 1, 2]

    # Rerun on the same machine, killed again mid-shard 5: shard 2 is uploaded from staging, not rewritten.
    def killed(*_):
        raise KeyboardInterrupt  # as a signal arriving mid-shard

    images = list(source.images)
    in_shard_5 = int(np.random.default_rng(SETTINGS.seed).permutation(30)[21])  # position 21 of the seeded order
    images[in_shard_5] = replace(images[in_shard_5], read=killed)
    written.clear(), uploads.clear()
    with pytest.raises(KeyboardInterrupt):
        write_shards(Source(source.name, images, None), url, SETTINGS, progress=False, staging=staging)
    assert written == [3, 4, 5]
    assert uploads[:4] == ["syn-000002.tar", "syn-000002.idx", ".ingest/000002.npy", ".ingest/000002.json"]
    assert not [key for key in uploads if "000000" in key or "000001" in key]

    # The pod restarts: a new staging directory.  Only the shards not on S3 are written.
    written.clear(), uploads.clear()
    write_shards(source, url, SETTINGS, progress=False, staging=tmp_path / "new-pod")
    assert written == [5, 6, 7]
    assert uploads[-3:] == ["skipped.jsonl", "samples.npy", "manifest.json"], "the manifest is uploaded last"
    assert manifest_sha256(url) == manifest_sha256(on_disk)
    assert copy_of(s3_env, url, tmp_path / "copy") == every_file(on_disk)


def test_parts_on_s3_then_merge_shards_on_the_prefix(s3_env, uploads, tmp_path, capsys):
    url = f"s3://{BUCKET}/sets/parts"
    common = ["make-shards", *SYNTHETIC, "--out", url]
    assert main(common + ["--part", "1/2", "--staging", str(tmp_path / "machine-1")]) == 0
    assert f"part 1/2 of {url} done; once every part is, run `instcls merge-shards {url}`" in capsys.readouterr().out
    assert main(["merge-shards", url]) == 2
    assert f"{url}: 4 of 8 shards are not written yet (0, 2, 4, 6)" in capsys.readouterr().err
    assert main(common + ["--part", "0/2", "--samples-per-shard", "5", "--staging", str(tmp_path / "m0")]) == 2
    assert f"{url}/.ingest/plan.json plans another ingest (num_shards: there 8, now 6; settings: there" in \
        capsys.readouterr().err, "a part with other settings is refused by the plan on S3"
    assert main(common + ["--part", "0/2", "--staging", str(tmp_path / "machine-0")]) == 0
    uploads.clear()
    assert main(common + ["--part", "1/2"]) == 0 and uploads == [], "a finished part, rerun, uploads nothing"
    assert main(["merge-shards", url]) == 0  # staged in the default place, under the temp dir
    assert f"wrote 30 instances in 8 shard(s) to {url}" in capsys.readouterr().out
    assert uploads == ["skipped.jsonl", "samples.npy", "manifest.json"], "the manifest is uploaded last"
    assert not list(Path(tempfile.gettempdir(), "instcls-staging", BUCKET, "sets", "parts").glob(".merge-*"))
    disk = tmp_path / "disk"
    assert main(["make-shards", *SYNTHETIC, "--out", str(disk)]) == 0
    assert manifest_sha256(url) == manifest_sha256(disk)
    assert main(["merge-shards", f"s3://{BUCKET}/sets/nothing"]) == 2
    assert (f"s3://{BUCKET}/sets/nothing/.ingest/plan.json not found: s3://{BUCKET}/sets/nothing holds no ingest to "
            "merge" in capsys.readouterr().err)


def test_bad_s3_targets_are_named_with_their_fix(s3_env, on_disk, tmp_path, monkeypatch, capsys):
    for command in (["make-shards", *SYNTHETIC, "--out", "s3://no-such-bucket/x"],
                    ["merge-shards", "s3://no-such-bucket/x"], ["validate-shards", "s3://no-such-bucket/x"]):
        assert main(command) == 2, command
        assert "bucket 'no-such-bucket' does not exist at http://127.0.0.1:" in capsys.readouterr().err
    # The bucket is checked before the source is listed (a walk of minutes at 14.2M files).
    assert main(["make-shards", "--source", "folder", "--root", str(tmp_path / "unlisted"), "--out",
                 "s3://no-such-bucket/x"]) == 2
    assert "bucket 'no-such-bucket' does not exist" in capsys.readouterr().err
    done = f"s3://{BUCKET}/sets/copied"
    s3_env.sync_up(on_disk, done)  # a set copied to S3 with another tool is a finished set there
    assert main(["validate-shards", done]) == 0
    assert main(["make-shards", *SYNTHETIC, "--out", done]) == 2
    assert f"{done}/manifest.json exists: this shard set is complete" in capsys.readouterr().err
    assert main(["make-shards", "--source", "tars", "--root", str(on_disk), "--out", done]) == 2
    assert "--source tars indexes the tars where they are" in capsys.readouterr().err
    assert main(["make-shards", *SYNTHETIC, "--out", str(tmp_path / "x"), "--staging", str(tmp_path / "s")]) == 2
    assert "only an s3:// --out is written through a staging directory" in capsys.readouterr().err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    forget_stores()
    assert main(["make-shards", *SYNTHETIC, "--out", f"s3://{BUCKET}/sets/refused"]) == 2
    error = capsys.readouterr().err
    assert f"s3://{BUCKET}/sets/refused: http://127.0.0.1:" in error and "refused the request's credentials" in error
    assert "AWS_ACCESS_KEY_ID" in error
