"""The sample table is memory-mapped (the index files are not needed to read), refused with the fix
when it does not fit its manifest, and a shard set from before it is read the same way, then
upgraded in place to identical reads."""

import hashlib
import io
import json
import shutil
import threading
import warnings

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from wds2idx import IndexCreator

from data_pipeline.ingest.make_shards import encode_int64, sha256_of
from data_pipeline.ingest.validate import validate_shards
from data_pipeline.loading.augment.augment_config import AugmentConfig
from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.loader_config import LoaderConfig
from data_pipeline.shardset.sample_table import LegacyShardSetWarning, SampleTable
from data_pipeline.shardset.table_file import empty_rows, write_table
from data_pipeline.shardset.table_file import sha256_of as sha256_of_file
from trainer.cli import main


def test_the_table_is_mapped_and_the_index_files_are_not_read(color_shards, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(color_shards, copy)
    expected = [(SampleTable(copy).read_jpeg(i), SampleTable(copy).read_label(i)) for i in range(45)]
    for index in copy.glob("*.idx"):
        index.unlink()
    table = SampleTable(copy)
    assert isinstance(table.rows, np.memmap)
    assert [(table.read_jpeg(i), table.read_label(i)) for i in range(45)] == expected
    assert table.describe(3) == f"{table.shard_of(3).tar} key ? (image at byte {table.rows[3]['offset']})"


@pytest.mark.parametrize("damage, message", [
    ("missing", "the sample table is missing"),
    ("truncated", "not a readable sample table"),
    ("another layout", "this version reads"),
    ("another set", "1797 rows, the manifest says 45 instances"),
    ("another order", "its rows do not match the manifest's shards"),
])
def test_a_table_that_does_not_fit_is_refused_with_the_fix(color_shards, digits_shards, tmp_path, damage, message):
    copy = tmp_path / "shards"
    shutil.copytree(color_shards, copy)
    table = copy / "samples.npy"
    if damage == "missing":
        table.unlink()
    elif damage == "truncated":
        table.write_bytes(table.read_bytes()[:-7])
    elif damage == "another layout":
        np.save(table, np.zeros(45, dtype=np.int64))
    elif damage == "another set":
        shutil.copy(digits_shards / "samples.npy", table)
    else:
        np.save(table, np.load(table)[::-1])
    with pytest.raises(ValueError, match=message) as refused:
        SampleTable(copy)
    assert str(refused.value).startswith(str(table)) and f"`instcls merge-shards {copy}`" in str(refused.value)
    assert main(["merge-shards", str(copy)]) == 0  # the fix it names: the records are still there
    assert SampleTable(copy).num_samples == 45


def _format_1_shard_set(directory, count=12, per_shard=5):
    """A shard set exactly as make-shards wrote them before the sample table: keys are ids, an .id
    component, DALI's indexer, a format-1 manifest."""
    rng = np.random.default_rng(1)
    directory.mkdir()
    shards = []
    for first in range(0, count, per_shard):
        name = f"old-{first // per_shard:06d}"
        with wds.TarWriter(str(directory / f"{name}.tar")) as writer:
            for i in range(first, min(first + per_shard, count)):
                jpeg = io.BytesIO()
                Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(jpeg, format="JPEG")
                writer.write({"__key__": f"{i:010d}", "jpg": jpeg.getvalue(), "id": encode_int64(i),
                              "cls": encode_int64(i % 4)})
        with IndexCreator(str(directory / f"{name}.tar"), str(directory / f"{name}.idx"), verbose=False) as creator:
            creator.create_index()
        shards.append({"tar": f"{name}.tar", "index": f"{name}.idx", "count": min(per_shard, count - first),
                       "first_id": first, "sha256": sha256_of(directory / f"{name}.tar")})
    (directory / "manifest.json").write_text(json.dumps({
        "num_instances": count, "shards": shards, "source": "old", "class_names": None,
        "skipped": [{"origin": "x.jpg", "reason": "bad"}], "format": "instcls-shards/1"}))


def _batches_digest(shard_dir):
    config = LoaderConfig(batch_size=4, backend="torch", num_threads=1, augment=AugmentConfig(image_size=16))
    digest = hashlib.sha256()
    for train in (True, False):
        for batch in build_loader(shard_dir, config, 0, 1, torch.device("cpu"), train=train).epoch_batches(0):
            digest.update(batch.views[0].numpy().tobytes() + batch.instance_ids.numpy().tobytes())
            if batch.labels is not None:
                digest.update(batch.labels.numpy().tobytes())
    return digest.hexdigest()


def test_a_format_1_shard_set_is_read_then_upgraded_to_identical_reads(tmp_path, capsys):
    old = tmp_path / "old"
    _format_1_shard_set(old)
    with pytest.warns(LegacyShardSetWarning, match=rf"Run `instcls upgrade-shards {old}` once"):
        table = SampleTable(old)
    assert [table.read_label(i) for i in range(12)] == [i % 4 for i in range(12)]
    before = [table.read_jpeg(i) for i in range(12)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyShardSetWarning)
        batches_before = _batches_digest(old)
        assert validate_shards(old, progress=False) == (12, [])
    tars = {p.name: p.read_bytes() for p in old.glob("*.tar")}
    assert main(["upgrade-shards", str(old)]) == 0
    assert "sample table samples.npy of 12 instances" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in old.glob("*.tar")} == tars, "the tars are not touched"
    with warnings.catch_warnings():
        warnings.simplefilter("error", LegacyShardSetWarning)
        upgraded = SampleTable(old)
        assert [upgraded.read_jpeg(i) for i in range(12)] == before
        assert _batches_digest(old) == batches_before
    assert upgraded.describe(7) == "old-000001.tar key 0000000007"
    assert json.loads((old / "skipped.jsonl").read_text()) == {"origin": "x.jpg", "reason": "bad"}
    assert validate_shards(old, progress=False) == (12, [])


def test_writers_racing_on_one_table_each_rename_their_own_whole_file(tmp_path):
    """A merge Job waiting beside an ingest that merges too writes the same table from two threads
    of one process (and two pods, both pid 1, would do so from two containers): each writer's
    temporary file must be its own, or one renames the other's away mid-write."""
    rows = empty_rows(50_000)
    rows["offset"] = np.arange(50_000)
    path, start, failures = tmp_path / "samples.npy", threading.Barrier(4), []

    def write_repeatedly():
        start.wait()
        for _ in range(10):
            try:
                digests.append(write_table(path, rows))
            except OSError as error:
                failures.append(error)

    digests: list[str] = []
    writers = [threading.Thread(target=write_repeatedly) for _ in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert failures == []
    assert set(digests) == {sha256_of_file(path)} and len(digests) == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples.npy"]
