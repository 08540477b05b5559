"""The images users already have: a flat or nested folder (labels optional, links followed), a list
of paths, and WebDataset tars indexed in place; each becomes a shard set whose ids read back the
right bytes and labels."""

import io
import json
import os

import numpy as np
import pytest
import webdataset as wds
from PIL import Image
from wds2idx import IndexCreator

from data_pipeline.ingest.make_shards import BadImageError, ShardSettings, sha256_of, write_shards
from data_pipeline.ingest.sources.files import image_folder, image_list
from data_pipeline.ingest.tars_in_place import index_tars
from data_pipeline.ingest.validate import validate_shards
from data_pipeline.shardset.manifest import ShardManifest
from data_pipeline.shardset.sample_table import SampleTable
from trainer.cli import main


def jpeg(colour, size=(24, 16)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="JPEG")
    return out.getvalue()


def png(colour) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (12, 12), colour).save(out, format="PNG")
    return out.getvalue()


def table_images(shard_dir):
    table = SampleTable(shard_dir)
    return [(table.read_jpeg(i), table.read_label(i)) for i in range(table.num_samples)]


def test_a_flat_folder_without_labels(tmp_path):
    root = tmp_path / "photos"
    root.mkdir()
    files = {f"IMG_{i:04d}.JPG": jpeg((10 * i, 255 - 10 * i, 7)) for i in range(20)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    (root / "notes.txt").write_text("not an image")
    (root / ".hidden.jpg").write_bytes(b"a hidden file is not listed")
    manifest = write_shards(image_folder(root), tmp_path / "out", ShardSettings(samples_per_shard=8), progress=False)
    assert manifest.num_instances == 20 and manifest.class_names is None and len(manifest.shards) == 3
    read = table_images(tmp_path / "out")
    assert sorted(data for data, _ in read) == sorted(files.values()), "baseline RGB JPEGs keep their bytes"
    assert {label for _, label in read} == {-1}
    assert validate_shards(tmp_path / "out", progress=False) == (20, [])


def test_a_nested_folder_with_labels_follows_links_and_cuts_loops(tmp_path):
    outside = tmp_path / "lake"
    (outside / "more").mkdir(parents=True)
    (outside / "more" / "c.png").write_bytes(png((0, 0, 200)))
    (outside / "lone.png").write_bytes(png((0, 200, 0)))
    root = tmp_path / "root"
    (root / "cats" / "deep").mkdir(parents=True)
    (root / "cats" / "a.png").write_bytes(png((200, 0, 0)))
    (root / "cats" / "deep" / "b.jpg").write_bytes(jpeg((90, 90, 0)))
    (root / "cats" / "link.png").symlink_to(outside / "lone.png")
    (root / "cats" / "broken.jpg").symlink_to(tmp_path / "gone.jpg")
    (root / "cats" / "loop").symlink_to(root, target_is_directory=True)
    (root / "dogs").symlink_to(outside, target_is_directory=True)  # a class folder elsewhere
    source = image_folder(root, labels=True)
    assert [os.path.relpath(image.origin, root) for image in source.images] == [
        "cats/a.png", "cats/broken.jpg", "cats/link.png", "cats/deep/b.jpg", "dogs/lone.png", "dogs/more/c.png"]
    assert source.class_names == ["cats", "dogs"] and [i.label for i in source.images] == [0, 0, 0, 0, 1, 1]
    with pytest.raises(BadImageError, match=r"cats/broken.jpg cannot be read"):
        write_shards(source, tmp_path / "stopped", ShardSettings(), progress=False)
    manifest = write_shards(source, tmp_path / "out", ShardSettings(on_bad_image="skip"), progress=False)
    assert manifest.num_instances == 5 and manifest.num_skipped == 1
    read = sorted((tuple(round(c / 50) for c in Image.open(io.BytesIO(data)).convert("RGB").getpixel((5, 5))), label)
                  for data, label in table_images(tmp_path / "out"))  # colours to the nearest 50: JPEG noise
    assert read == [((0, 0, 4), 1), ((0, 4, 0), 0), ((0, 4, 0), 1), ((2, 2, 0), 0), ((4, 0, 0), 0)]
    (root / "loose.png").write_bytes(png((1, 2, 3)))
    with pytest.raises(ValueError, match=r"loose.png \(and 0 more\) is not in a class subfolder.*--labels none"):
        image_folder(root, labels=True)
    assert len(image_folder(root).images) == 7


def test_a_list_and_a_csv_with_labels(tmp_path):
    images = tmp_path / "lake"
    images.mkdir()
    for name, colour in (("a.jpg", (250, 0, 0)), ("b.jpg", (0, 250, 0)), ("c.jpg", (0, 0, 250))):
        (images / name).write_bytes(jpeg(colour))
    listing = tmp_path / "export.txt"
    listing.write_text(f"# exported\nlake/c.jpg\n\n{images / 'a.jpg'}\n")
    source = image_list(listing)
    assert [image.origin for image in source.images] == [str(tmp_path / "lake/c.jpg"), str(images / "a.jpg")]
    csv_file = tmp_path / "labels.csv"
    csv_file.write_text("path,label,score\nb.jpg,dog,1\nc.jpg,cat,2\na.jpg,dog,3\n")
    source = image_list(csv_file, root=images, labels=True)
    assert source.class_names == ["cat", "dog"] and [i.label for i in source.images] == [1, 0, 1]
    manifest = write_shards(source, tmp_path / "out", ShardSettings(samples_per_shard=2), progress=False)
    brightest = {int(np.argmax(Image.open(io.BytesIO(data)).getpixel((3, 3)))): label
                 for data, label in table_images(tmp_path / "out")}
    assert brightest == {0: 1, 1: 1, 2: 0} and manifest.class_names == ["cat", "dog"]  # a, b: dog; c: cat
    (tmp_path / "paths.csv").write_text("path\na.jpg\n")
    with pytest.raises(ValueError, match=r"paths.csv: the header \['path'\] lacks column\(s\) \['label'\]"):
        image_list(tmp_path / "paths.csv", labels=True)
    with pytest.raises(ValueError, match="a plain list has no labels"):
        image_list(listing, labels=True)


def _write_tar(path, samples):
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as writer:  # float member times, pax headers: as other tools write them
        for sample in samples:
            writer.write(sample)


def test_existing_tars_are_indexed_in_place(tmp_path):
    tars = tmp_path / "tars"
    first = [{"__key__": "img/abc", "jpg": jpeg((255, 0, 0)), "cls": b"3", "json": b"{}"},
             {"__key__": "x-1", "jpg": b"\xff\xd8 not a jpeg", "cls": b"1"},
             {"__key__": "x-2", "json": b"{\"no\": \"image\"}", "cls": b"2"},
             {"__key__": "x-3", "png": png((0, 255, 0)), "cls": b"7\n"}]
    second = [{"__key__": "q", "jpeg": jpeg((0, 0, 255)), "cls": np.int64(5).tobytes()}]
    _write_tar(tars / "b" / "0001.tar", first)
    _write_tar(tars / "a.tar", second)
    before = {p: sha256_of(p) for p in tars.rglob("*.tar")}
    with pytest.raises(BadImageError, match=r"b/0001.tar key x-1 image does not decode"):
        index_tars(tars, tmp_path / "index", labels=True, workers=1, progress=False)
    manifest = index_tars(tars, tmp_path / "index", labels=True, on_bad_image="skip", workers=2, progress=False)
    assert {p: sha256_of(p) for p in tars.rglob("*.tar")} == before, "indexing in place never writes a tar"
    assert [(e.tar, e.index, e.count, e.first_id) for e in manifest.shards] == [
        ("../tars/a.tar", "a.idx", 1, 0), ("../tars/b/0001.tar", "b/0001.idx", 2, 1)]
    read = table_images(tmp_path / "index")  # ids: tar path order, then member order
    assert read == [(second[0]["jpeg"], 5), (first[0]["jpg"], 3), (first[3]["png"], 7)]
    report = [json.loads(line) for line in (tmp_path / "index" / "skipped.jsonl").read_text().splitlines()]
    assert [(r["origin"].rsplit("/", 2)[-2:], r["reason"].split(" (")[0]) for r in report] == [
        (["b", "0001.tar key x-1"], "image does not decode"),
        (["b", "0001.tar key x-2"], "has no image component")]
    for tar, index in (("a.tar", "a.idx"), ("b/0001.tar", "b/0001.idx")):  # DALI's own indexer: the reference
        with IndexCreator(str(tars / tar), str(tmp_path / "reference.idx"), verbose=False) as creator:
            creator.create_index()
        assert (tmp_path / "index" / index).read_text() == (tmp_path / "reference.idx").read_text()
    assert validate_shards(tmp_path / "index", progress=False) == (3, [])
    assert SampleTable(tmp_path / "index").describe(2) == "../tars/b/0001.tar key x-3"


def test_cli_indexes_tars_next_to_themselves(tmp_path, capsys):
    tars = tmp_path / "tars"
    _write_tar(tars / "s-0.tar", [{"__key__": f"k{i}", "jpg": jpeg((i * 40, 0, 0))} for i in range(3)])
    assert main(["make-shards", "--source", "tars", "--root", str(tars), "--out", str(tars), "--no-progress"]) == 0
    manifest = ShardManifest.load(tars)
    assert manifest.num_instances == 3 and [shard.tar for shard in manifest.shards] == ["s-0.tar"]
    assert (tars / "s-0.idx").is_file()
    assert [label for _, label in table_images(tars)] == [-1, -1, -1]
    assert main(["make-shards", "--source", "tars", "--root", str(tars), "--out", str(tmp_path / "o"),
                 "--labels", "cls", "--no-progress"]) == 2
    assert "k0 has no .cls component (asked for with --labels cls)" in capsys.readouterr().err
