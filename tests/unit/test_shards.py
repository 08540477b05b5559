"""make-shards writes what the manifest says; bad images are refused or skipped, never shipped."""

import io
import shutil
import tarfile

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from data_pipeline.manifest import ShardManifest
from data_pipeline.shards import BadImageError, ShardSettings, decode_int64, encode_int64, sha256_of, write_shards
from data_pipeline.sources import image_folder, synthetic
from data_pipeline.validate import validate_shards
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
    ids, labels = [], []
    for shard in manifest.shards:
        assert sha256_of(digits_shards / shard.tar) == shard.sha256
        assert (digits_shards / shard.index).read_text().startswith(f"v1.2 {shard.count}\n")
        for key, sample in read_samples(digits_shards / shard.tar).items():
            instance_id = decode_int64(sample["id"])
            assert key == f"{instance_id:010d}"
            assert shard.first_id <= instance_id < shard.first_id + shard.count
            ids.append(instance_id)
            labels.append(decode_int64(sample["cls"]))
            assert Image.open(io.BytesIO(sample["jpg"])).size == (32, 32)
    assert sorted(ids) == list(range(1797))
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
    assert not list((tmp_path / "out").glob("*.tmp")), "a failed run must not leave partial files"


def test_bad_images_can_be_skipped_and_counted(folder_with_bad_images, tmp_path):
    manifest = write_shards(
        image_folder(folder_with_bad_images), tmp_path / "out", ShardSettings(on_bad_image="skip"), progress=False
    )
    assert manifest.num_instances == 45
    assert sorted(s["origin"].rsplit("/", 1)[1] for s in manifest.skipped) == ["corrupt.jpg", "truncated.jpg"]
    assert validate_shards(tmp_path / "out", progress=False)[1] == []


def test_existing_shard_set_is_not_overwritten(digits_shards):
    with pytest.raises(FileExistsError, match="manifest.json exists"):
        write_shards(synthetic(4, 16), digits_shards, ShardSettings(), progress=False)


def test_large_images_are_shrunk_when_asked(tmp_path):
    manifest = write_shards(synthetic(3, 64), tmp_path, ShardSettings(max_side=40), progress=False)
    sample = next(iter(read_samples(tmp_path / manifest.shards[0].tar).values()))
    assert Image.open(io.BytesIO(sample["jpg"])).size == (40, 40)
    assert decode_int64(sample["cls"]) == -1


def _rewrite_shard(shard_dir, shard_index, edit):
    """Rewrite one shard's samples through ``edit(samples)`` and refresh its checksum."""
    manifest = ShardManifest.load(shard_dir)
    entry = manifest.shards[shard_index]
    samples = list(read_samples(shard_dir / entry.tar).values())
    with wds.TarWriter(str(shard_dir / entry.tar)) as writer:
        for sample in edit(samples):
            writer.write({k: v for k, v in sample.items() if k != "__url__" and k != "__local_path__"})
    entry_dict = entry.__dict__ | {"sha256": sha256_of(shard_dir / entry.tar)}
    manifest.shards[shard_index] = type(entry)(**entry_dict)
    manifest.save(shard_dir)
    return entry


@pytest.fixture
def color_copy(color_shards, tmp_path):
    shutil.copytree(color_shards, tmp_path / "shards")
    return tmp_path / "shards"


def test_validate_reports_corrupt_image_by_shard_and_key(color_copy):
    def corrupt_second(samples):
        samples[1]["jpg"] = samples[1]["jpg"][:100]
        return samples

    entry = _rewrite_shard(color_copy, 1, corrupt_second)
    _, problems = validate_shards(color_copy, progress=False)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{entry.tar} key {entry.first_id + 1:010d}: image does not decode (")
    assert "truncated" in problems[0] or "OSError" in problems[0]


def test_validate_reports_missing_component_duplicate_and_missing_ids(color_copy):
    def break_samples(samples):
        del samples[0]["cls"]
        samples[2]["id"] = samples[3]["id"]  # a duplicate id (and one id now missing)
        return samples

    entry = _rewrite_shard(color_copy, 0, break_samples)
    _, problems = validate_shards(color_copy, progress=False)
    assert f"{entry.tar} key 0000000000: missing component(s) .cls" in problems
    assert "1 instance id(s) appear more than once, e.g. [3]" in problems
    assert "1 instance id(s) of 0..44 are missing, e.g. [2]" in problems


def test_validate_reports_checksum_and_truncated_tar(color_copy):
    manifest = ShardManifest.load(color_copy)
    tar_path = color_copy / manifest.shards[2].tar
    tar_path.write_bytes(tar_path.read_bytes()[:5000])
    _, problems = validate_shards(color_copy, progress=False)
    assert f"{manifest.shards[2].tar}: sha256 differs from the manifest (file changed or truncated)" in problems
    assert any(p.startswith(f"{manifest.shards[2].tar}: unreadable tar") or "holds" in p for p in problems), problems


def test_cli_make_and_validate(tmp_path, capsys):
    out = tmp_path / "synthetic"
    assert main(["make-shards", "--source", "synthetic", "--count", "12", "--image-size", "24", "--out", str(out),
                 "--samples-per-shard", "5"]) == 0
    assert "wrote 12 instances in 3 shard(s)" in capsys.readouterr().out
    assert main(["validate-shards", str(out)]) == 0
    (out / "manifest.json").unlink()
    assert main(["validate-shards", str(out)]) == 2
    assert "run it again" in capsys.readouterr().err
    assert main(["make-shards", "--source", "folder", "--out", str(tmp_path / "x")]) == 2
    assert "--source folder needs --root" in capsys.readouterr().err


def test_cli_validate_exits_nonzero_on_problems(color_copy, capsys):
    ShardManifest.load(color_copy)
    first = sorted(color_copy.glob("*.tar"))[0]
    with tarfile.open(first, "a") as archive:  # an extra sample without image or label
        info = tarfile.TarInfo("9999999999.id")
        payload = encode_int64(9999)
        info.size = len(payload)
        archive.addfile(info, io.BytesIO(payload))
    assert main(["validate-shards", str(color_copy)]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM colors-000000.tar key 9999999999: missing component(s) .jpg, .cls" in out


def test_image_folder_refuses_links_that_leave_its_root(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.png"
    secret.write_bytes(b"not for the shards")
    root = tmp_path / "root"
    (root / "cats").mkdir(parents=True)
    (root / "cats" / "ok.png").write_bytes(b"inside")
    assert len(image_folder(root).images) == 1
    (root / "cats" / "link.png").symlink_to(secret)
    with pytest.raises(ValueError, match=r"cats/link.png resolves to .*secret.png, outside the image folder"):
        image_folder(root)
    (root / "cats" / "link.png").unlink()
    (root / "dogs").symlink_to(outside, target_is_directory=True)  # a whole class folder elsewhere
    with pytest.raises(ValueError, match=r"dogs resolves to .*outside, outside the image folder"):
        image_folder(root)
