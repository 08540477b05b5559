"""A part of an ingest holds only its share of the listing, and its shards are the ones every
earlier ingest wrote: shard j is positions ``[j*S, (j+1)*S)`` of the listing shuffled by
``np.random.default_rng(seed).permutation(N)``, and the listing digest in ``plan.json`` is unchanged.
Its memory grows with its share (N / parts), not with N."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.ingest.ingest_state import Part
from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.part_listing import list_part, seeded_order
from data_pipeline.ingest.shard_merge import merge_shards
from data_pipeline.ingest.sources.files import image_folder, image_list
from data_pipeline.ingest.sources.generated import synthetic
from tests.unit.test_ingest_resume import files_of

SEED, PER_SHARD = 5, 4


def _folder(root: Path) -> Path:
    for index in range(23):  # 3 classes of uneven sizes, one nested deeper; make_shards reads no byte here
        path = root / "photos" / ["cat", "dog", "eel/deep"][index % 3] / f"{index:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    return root / "photos"


def _csv(root: Path) -> Path:
    path = root / "list.csv"
    path.write_text("path,label\n" + "".join(f"img/{i}.jpg,{'zebra' if i % 4 else 'ant'}\n" for i in range(37)))
    return path


def _text(root: Path) -> Path:
    path = root / "list.txt"
    path.write_text("# listed\n" + "".join(f"/abs/{i}.png\n\n" for i in range(29)))
    return path


SOURCES = {
    "synthetic": lambda root: synthetic(41, 16, seed=2),
    "folder with labels": lambda root: image_folder(_folder(root), labels=True),
    "folder": lambda root: image_folder(_folder(root)),
    "csv with labels": lambda root: image_list(_csv(root), labels=True),
    "text list": lambda root: image_list(_text(root)),
}


def _historical_digest(source, records) -> str:
    """The listing digests make-shards has always written: origins and labels per line (generated
    sources), or the root-relative paths, then the int32 labels (files)."""
    digest = hashlib.sha256()
    if source.name.startswith("synthetic"):
        for record in records:
            digest.update(f"{record.origin}\t{record.label}\n".encode())
        return digest.hexdigest()
    root = source.images.root
    for record in records:
        digest.update((record.origin[len(root) + 1:] if record.origin.startswith(root + "/")
                       else record.origin).encode() + b"\n")
    digest.update(np.array([record.label for record in records], dtype=np.int32).tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("kind", list(SOURCES))
def test_each_part_holds_exactly_its_shards_images_in_the_historical_order(kind, tmp_path):
    source = SOURCES[kind](tmp_path)
    records = list(source.images)  # the whole listing, as every part used to hold it
    order = np.random.default_rng(SEED).permutation(len(records))
    assert np.array_equal(seeded_order(len(records), SEED), order)
    num_shards = -(-len(records) // PER_SHARD)
    for parts in (1, 3):
        for index in range(parts):
            listing = list_part(source, PER_SHARD, SEED, Part(index, parts))
            assert listing.count == len(records) and listing.num_shards == num_shards
            assert listing.sha256 == _historical_digest(source, records)
            shards = list(range(index, num_shards, parts))
            assert len(listing.images) == sum(len(order[j * PER_SHARD: (j + 1) * PER_SHARD]) for j in shards)
            for number in shards:
                expected = [records[i] for i in order[number * PER_SHARD: (number + 1) * PER_SHARD]]
                held = listing.shard_images(number)
                assert [(r.origin, r.label) for r in held] == [(r.origin, r.label) for r in expected]
            with pytest.raises(ValueError, match="is not one of part"):
                listing.shard_images(index + 1 if parts > 1 else num_shards)
    if kind == "folder with labels":
        assert source.class_names == ["cat", "dog", "eel"]
        assert sorted({r.label for r in records}) == [0, 1, 2]


def test_parts_of_a_labelled_folder_write_the_bytes_of_one_run(tmp_path):
    settings = ShardSettings(prefix="pics", samples_per_shard=PER_SHARD, workers=1, seed=SEED)
    folder = tmp_path / "in"
    for index in range(11):  # real images this time: the tars are compared byte for byte
        path = folder / ("a" if index % 2 else "b") / f"{index}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(synthetic(11, 16).images[index].read())
    write_shards(image_folder(folder, labels=True), tmp_path / "one", settings, progress=False)
    for index in (1, 0):
        write_shards(image_folder(folder, labels=True), tmp_path / "parts", settings, progress=False,
                     part=Part(index, 2))
    merge_shards(tmp_path / "parts")
    assert files_of(tmp_path / "parts") == files_of(tmp_path / "one")


_MEASURE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from data_pipeline.ingest.ingest_state import Part
    from data_pipeline.ingest.part_listing import list_part
    from data_pipeline.ingest.sources.files import image_list

    def status(name):  # as trainer.observability.memory reads it, without importing torch
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(name + ":"))

    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # the high-water mark restarts at the RSS now
    baseline = status("VmRSS")
    listing = list_part(image_list(Path(sys.argv[1])), 1000, 0, Part.parse(sys.argv[2]))
    print(len(listing.images), status("VmHWM") - baseline)
""")


def test_a_parts_memory_grows_with_its_share_of_the_listing_not_the_whole(tmp_path):
    """Peak RSS above the process's start, listing 300,000 paths (ImageNet-21K's shape: folder/file):
    an eighth of the listing holds well under half of what the whole listing does."""
    listing = tmp_path / "listing.txt"
    listing.write_text("".join(f"n{i % 997:08d}/n{i % 997:08d}_{i}.JPEG\n" for i in range(300_000)))
    growth = {}
    repo = Path(__file__).resolve().parents[2]
    for part in ("0/1", "7/8"):
        out = subprocess.run([sys.executable, "-c", _MEASURE, str(listing), part], capture_output=True, text=True,
                             check=True, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
        held, grown = map(int, out.stdout.split())
        growth[part] = grown
        assert held == (300_000 if part == "0/1" else 37_000)  # shards 7, 15, ..., 295 of 300
    assert growth["0/1"] > 20 * 2**20, growth  # the whole listing: ~100 bytes a path
    assert growth["7/8"] < 0.4 * growth["0/1"], growth


def test_listing_only_reports_a_parts_share_and_writes_nothing(tmp_path, capsys):
    from trainer.cli import main

    out = tmp_path / "never"
    assert main(["make-shards", "--source", "list", "--list", str(_csv(tmp_path)), "--labels", "column", "--out",
                 str(out), "--part", "1/3", "--samples-per-shard", str(PER_SHARD), "--listing-only"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("part 1/3: 12 of 37 images in 3 of 10 shards;") and "peak RSS" in printed, printed
    assert not out.exists()
    with pytest.raises(SystemExit, match="--source tars indexes tars in place"):
        main(["make-shards", "--source", "tars", "--root", str(tmp_path), "--out", str(out), "--listing-only"])
