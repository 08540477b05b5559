"""An ingest's output depends on its inputs only: any number of workers or parts gives the same
bytes, and a killed run, resumed, ends with exactly the shards of an uninterrupted one."""

import os
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from data_pipeline.ingest.ingest_state import Part
from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.shard_merge import merge_shards
from data_pipeline.ingest.sources.generated import Source, synthetic
from data_pipeline.shardset.manifest import ShardManifest
from trainer.cli import main

SETTINGS = ShardSettings(prefix="syn", samples_per_shard=4, workers=1)


def files_of(shard_dir):
    """Every file a reader uses (not the ingest's own records), name -> bytes."""
    return {p.name: p.read_bytes() for p in sorted(shard_dir.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def source():
    return synthetic(30, 16, seed=4)


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    write_shards(source, out, SETTINGS, progress=False)
    return files_of(out)


def test_any_workers_and_parts_give_the_same_shard_set(source, reference, tmp_path):
    assert len([name for name in reference if name.endswith(".tar")]) == 8
    assert {"manifest.json", "samples.npy", "skipped.jsonl", "syn-000000.idx"} <= reference.keys()
    out = tmp_path / "parts"
    for index in (2, 0):
        assert write_shards(source, out, replace(SETTINGS, workers=2), progress=False, part=Part(index, 3)) is None
    with pytest.raises(ValueError, match=r"3 of 8 shards are not written yet \(1, 4, 7\).*--part I/K"):
        merge_shards(out)
    finisher = threading.Timer(0.3, write_shards, (source, out, SETTINGS), {"progress": False, "part": Part(1, 3)})
    finisher.start()
    merge_shards(out, wait_seconds=60, poll_seconds=0.1)  # a merge Job started beside the parts waits for them
    finisher.join()
    assert files_of(out) == reference
    # A merge that starts before any part has listed the source (no plan yet) waits for the plan too.
    early = tmp_path / "early"
    writer = threading.Timer(0.3, write_shards, (source, early, SETTINGS), {"progress": False})
    writer.start()
    merge_shards(early, wait_seconds=60, poll_seconds=0.1)
    writer.join()
    assert files_of(early) == reference
    with pytest.raises(FileNotFoundError, match="holds no ingest to merge"):
        merge_shards(tmp_path / "never", wait_seconds=0.2, poll_seconds=0.05)


def test_a_killed_ingest_resumes_to_identical_shards(source, reference, tmp_path):
    out = tmp_path / "killed"

    def killed(*_):
        raise KeyboardInterrupt  # as a signal arriving mid-shard

    images = list(source.images)
    thirteenth = int(np.random.default_rng(SETTINGS.seed).permutation(30)[13])  # of the seeded order: in shard 3
    images[thirteenth] = replace(images[thirteenth], read=killed)  # the same listing: only reading fails
    with pytest.raises(KeyboardInterrupt):
        write_shards(Source(source.name, images, None), out, SETTINGS, progress=False)
    assert sorted(p.name for p in out.glob("*.tar")) == [f"syn-{n:06d}.tar" for n in range(3)]
    # What a SIGKILL leaves besides: a half-written tar, and a shard renamed into place whose record
    # was never written (so it is not done).
    (out / "syn-000005.tar.tmp-99999").write_bytes(b"half a tar")
    (out / ".ingest" / "000002.json").unlink()
    finished_first = (out / "syn-000000.tar").stat().st_mtime_ns
    write_shards(source, out, replace(SETTINGS, workers=2), progress=False)
    assert files_of(out) == reference
    assert (out / "syn-000000.tar").stat().st_mtime_ns == finished_first, "a finished shard is not written again"


def test_another_listing_or_setting_is_refused_in_the_same_directory(source, tmp_path):
    out = tmp_path / "out"
    write_shards(source, out, SETTINGS, progress=False, part=Part(0, 2))
    with pytest.raises(ValueError, match=r"plans another ingest \(count: there 30, now 31; listing_sha256: .*"
                                         r"finish it, or write to another --out"):
        write_shards(synthetic(31, 16, seed=4), out, SETTINGS, progress=False, part=Part(1, 2))
    with pytest.raises(ValueError, match=r"settings: there .*\"samples_per_shard\": 4.*now .*\"samples_per_shard\": 5"):
        write_shards(source, out, replace(SETTINGS, samples_per_shard=5), progress=False, part=Part(1, 2))


def test_cli_parts_and_merge(tmp_path, capsys):
    out = str(tmp_path / "out")
    common = ["make-shards", "--source", "synthetic", "--count", "9", "--image-size", "16", "--out", out,
              "--samples-per-shard", "2", "--no-progress"]
    assert main(common + ["--part", "1/2"]) == 0
    assert f"part 1/2 of {out} done; once every part is, run `instcls merge-shards {out}`" in capsys.readouterr().out
    assert main(["merge-shards", out]) == 2
    assert "3 of 5 shards are not written yet (0, 2, 4)" in capsys.readouterr().err
    assert main(common + ["--part", "0/2"]) == 0 and main(["merge-shards", out]) == 0
    merged = ShardManifest.load(out)
    assert (merged.num_instances, len(merged.shards)) == (9, 5)
    capsys.readouterr()
    assert main(common + ["--part", "2/2"]) == 2
    assert "--part '2/2': write I/K with 0 <= I < K" in capsys.readouterr().err
    os.remove(os.path.join(out, "manifest.json"))
    assert main(common) == 0, "every shard is done: the rerun only merges"
    assert ShardManifest.load(out) == merged
    started = time.monotonic()
    assert main(["merge-shards", str(tmp_path / "nothing")]) == 2
    assert "holds no ingest to merge" in capsys.readouterr().err and time.monotonic() - started < 5
