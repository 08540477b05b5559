"""make-shards writes what the manifest says; bad images are refused or skipped, never shipped;
validate-shards finds what was damaged afterwards."""

import io
import json
import shutil
import tarfile

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from data_pipeline.ingest.make_shards import (
    BadImageError,
    ShardSettings,
    decode_int64,
    encode_int64,
    sha256_of,
    write_shards,
)
from data_pipeline.ingest.sources.files import image_folder
from data_pipeline.ingest.sources.generated import synthetic
from data_pipeline.ingest.validate import validate_shards
from data_pipeline.shardset.manifest import ShardManifest
from data_pipeline.shardset.sample_table import SampleTable
from trainer.cli import main


def read_samples(tar_path):
    samples = {}
    for sample in wds.DataPipeline(wds.SimpleShardList([str(tar_path)]), wds.tarfile_to_samples()):
        samples[sample["__key__"]] = sample
    return samples


def test_digits_shards_match_their_manifest(digits_shards):
    manifest = ShardManifest.load(digits_shards)
    assert manifest.num_instances == 1797 and manifest.class_names == [str(d) for d in range(10)]
    assert [s.count for s in manifest.shards] == [400, 400, 400, 400, 197]
    table = SampleTable(digits_shards)
    labels, seen = [], set()
    for shard in manifest.shards:
        assert sha256_of(digits_shards / shard.tar) == shard.sha256
        assert (digits_shards / shard.index).read_text().startswith(f"v1.2 {shard.count}\n")
        samples = read_samples(digits_shards / shard.tar)
        assert len(samples) == shard.count
        for position, (key, sample) in enumerate(samples.items()):
            instance_id = shard.first_id + position  # ids: shard order, then stored order
            assert key == f"{instance_id:010d}", "nothing skipped: the key is the id"
            assert table.read_jpeg(instance_id) == sample["jpg"]
            labels.append(decode_int64(sample["cls"]))
            assert table.read_label(instance_id) == labels[-1]
            assert Image.open(io.BytesIO(sample["jpg"])).size == (32, 32)
            seen.add(instance_id)
    assert seen == set(range(1797))
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]  # load_digits' classes
    assert labels[:20] != sorted(labels[:20]), "stored order should be shuffled, not class-sorted"
    assert validate_shards(digits_shards, progress=False) == (1797, [])


@pytest.fixture
def folder_with_bad_images(color_folder, tmp_path):
    root = tmp_path / "images"
    shutil.copytree(color_folder, root)
    (root / "class0" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    good = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(good, format="JPEG")
    (root / "class1" / "truncated.jpg").write_bytes(good.getvalue()[:300])
    return root


def test_bad_image_is_refused_with_its_path(folder_with_bad_images, tmp_path):
    with pytest.raises(BadImageError, match=r"(corrupt|truncated)\.jpg .*--on-bad-image skip"):
        write_shards(image_folder(folder_with_bad_images), tmp_path / "out", ShardSettings(), progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not list((tmp_path / "out").glob("*.tmp*")), "a failed run must not leave partial files"


def test_bad_images_can_be_skipped_and_reported(folder_with_bad_images, tmp_path):
    out = tmp_path / "out"
    manifest = write_shards(image_folder(folder_with_bad_images, labels=True), out,
                            ShardSettings(on_bad_image="skip", samples_per_shard=10), progress=False)
    assert manifest.num_instances == 45 and manifest.num_skipped == 2
    report = [json.loads(line) for line in (out / manifest.skipped_report).read_text().splitlines()]
    assert sorted(problem["origin"].rsplit("/", 1)[1] for problem in report) == ["corrupt.jpg", "truncated.jpg"]
    assert all("does not decode" in problem["reason"] for problem in report)
    assert validate_shards(out, progress=False) == (45, [])
    # Keys are positions in the seeded order; ids stay dense 0..44 in shard order without the two.
    listed = list(image_folder(folder_with_bad_images, labels=True).images)  # a folder's listing is streamed
    order = np.random.default_rng(0).permutation(len(listed))
    bad = {position for position, index in enumerate(order)
           if listed[int(index)].origin.endswith(("corrupt.jpg", "truncated.jpg"))}
    keys = [key for entry in manifest.shards for key in read_samples(out / entry.tar)]
    assert keys == [f"{position:010d}" for position in range(47) if position not in bad]
    table = SampleTable(out)
    good = [listed[int(index)] for position, index in enumerate(order) if position not in bad]
    assert [table.read_label(i) for i in range(45)] == [image.label for image in good]


def test_existing_shard_set_is_not_overwritten(digits_shards):
    with pytest.raises(FileExistsError, match="manifest.json exists"):
        write_shards(synthetic(4, 16), digits_shards, ShardSettings(), progress=False)


def test_large_images_are_shrunk_when_asked(tmp_path):
    manifest = write_shards(synthetic(3, 64), tmp_path, ShardSettings(max_side=40), progress=False)
    sample = next(iter(read_samples(tmp_path / manifest.shards[0].tar).values()))
    assert Image.open(io.BytesIO(sample["jpg"])).size == (40, 40)
    assert decode_int64(sample["cls"]) == -1


@pytest.fixture
def color_copy(color_shards, tmp_path):
    shutil.copytree(color_shards, tmp_path / "shards")
    return tmp_path / "shards"


def _refresh_checksums(shard_dir):
    """What someone who rewrote files would also do: make the manifest's checksums match again."""
    manifest = ShardManifest.load(shard_dir)
    manifest.shards = [type(e)(**(e.__dict__ | {"sha256": sha256_of(shard_dir / e.tar)})) for e in manifest.shards]
    manifest.table_sha256 = sha256_of(shard_dir / manifest.table)
    manifest.save(shard_dir)


def test_validate_reports_corrupt_image_by_shard_and_key(color_copy):
    entry = ShardManifest.load(color_copy).shards[1]
    with tarfile.open(color_copy / entry.tar) as archive:
        member = [m for m in archive.getmembers() if m.name.endswith(".jpg")][1]
    blob = bytearray((color_copy / entry.tar).read_bytes())
    blob[member.offset_data:member.offset_data + 16] = bytes(16)  # same length: only the image is damaged
    (color_copy / entry.tar).write_bytes(bytes(blob))
    _refresh_checksums(color_copy)
    checked, problems = validate_shards(color_copy, progress=False)
    assert checked == 45 and len(problems) == 1, problems
    assert problems[0].startswith(f"{entry.tar} key {member.name.split('.')[0]}: image does not decode (")


def test_validate_reports_a_stale_index_and_table_rows_that_point_elsewhere(color_copy):
    manifest = ShardManifest.load(color_copy)
    entry = manifest.shards[0]
    samples = list(read_samples(color_copy / entry.tar).values())
    del samples[0]["cls"]  # rewritten without one component: every later offset moves
    with wds.TarWriter(str(color_copy / entry.tar)) as writer:
        for sample in samples:
            writer.write({k: v for k, v in sample.items() if k not in ("__url__", "__local_path__")})
    table = np.load(color_copy / manifest.table)
    table[12] = table[11]  # shard 1 lists one of its samples twice
    table[30]["shard"] = 0  # and a row claims another shard than its id range
    np.save(color_copy / manifest.table, table)
    _refresh_checksums(color_copy)
    _, problems = validate_shards(color_copy, progress=False)
    assert problems[0] == ("samples.npy: 1 row(s) lie in another shard than the manifest's id ranges say, "
                           "e.g. ids [30]").replace("samples.npy", str(color_copy / "samples.npy"))
    assert f"{entry.index}: sample 0 (0000000000) differs from {entry.tar}'s members; re-index the tar" in problems
    with tarfile.open(color_copy / entry.tar) as archive:  # where the rewritten tar's images start now
        images = {(m.offset_data, m.size) for m in archive.getmembers() if m.name.endswith(".jpg")}
    moved = [i for i in range(10) if (int(table[i]["offset"]), int(table[i]["size"])) not in images]
    assert len(moved) >= 8, "the rewrite moves (nearly) every image"
    assert [p for p in problems if p.startswith(f"{entry.tar}: id ")] == [
        f"{entry.tar}: id {i} points at byte {table[i]['offset']}, where no image of {table[i]['size']} bytes "
        "starts; rebuild the sample table" for i in moved]
    assert sum(p.startswith(f"{manifest.shards[1].tar} key ") and p.endswith(": listed twice in the sample table")
               for p in problems) == 1


def test_validate_reports_checksum_and_truncated_tar(color_copy):
    manifest = ShardManifest.load(color_copy)
    tar_path = color_copy / manifest.shards[2].tar
    tar_path.write_bytes(tar_path.read_bytes()[:5000])
    _, problems = validate_shards(color_copy, progress=False)
    assert f"{manifest.shards[2].tar}: sha256 differs from the manifest (file changed or truncated)" in problems
    assert any(p.startswith(f"{manifest.shards[2].tar}: unreadable tar") or "where no image" in p
               for p in problems), problems


def test_cli_make_and_validate(tmp_path, capsys):
    out = tmp_path / "synthetic"
    assert main(["make-shards", "--source", "synthetic", "--count", "12", "--image-size", "24", "--out", str(out),
                 "--samples-per-shard", "5", "--no-progress"]) == 0
    manifest = ShardManifest.load(out)
    assert (manifest.num_instances, len(manifest.shards)) == (12, 3)
    # The line it ends with gives those counts (the one test of that line's text).
    assert f"wrote {manifest.num_instances} instances in {len(manifest.shards)} shard(s)" in capsys.readouterr().out
    assert main(["validate-shards", str(out)]) == 0
    (out / "manifest.json").unlink()
    assert main(["validate-shards", str(out)]) == 2
    assert "run it again, it resumes" in capsys.readouterr().err
    assert main(["make-shards", "--source", "folder", "--out", str(tmp_path / "x")]) == 2
    assert "--source folder needs --root" in capsys.readouterr().err
    assert main(["make-shards", "--source", "synthetic", "--labels", "cls", "--out", str(tmp_path / "x")]) == 2
    assert "--labels cls does not apply to --source synthetic" in capsys.readouterr().err


def test_cli_validate_exits_nonzero_on_problems(color_copy, capsys):
    first = sorted(color_copy.glob("*.tar"))[0]
    with tarfile.open(first, "a") as archive:  # an extra sample without image or label
        info = tarfile.TarInfo("9999999999.id")
        payload = encode_int64(9999)
        info.size = len(payload)
        archive.addfile(info, io.BytesIO(payload))
    assert main(["validate-shards", str(color_copy)]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM colors-000000.tar: sha256 differs from the manifest (file changed or truncated)" in out
    assert "PROBLEM colors-000000.idx: lists 10 samples, colors-000000.tar holds 11; re-index the tar" in out
