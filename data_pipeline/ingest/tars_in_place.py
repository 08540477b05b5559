"""Existing WebDataset tars as a shard set, indexed in place: nothing is re-encoded or copied.

``make-shards --source tars --root TARS --out OUT`` lists ``TARS/**/*.tar`` in sorted path order;
ids follow that order, then member order, so they are deterministic and 0..N-1 whatever the keys
are.  Each tar is one job (``index_tar``): its DALI index goes to ``OUT`` (mirroring the tar's
place under ``TARS``; ``OUT`` may be ``TARS`` itself), every image is fully decoded (a DALI
pipeline dies on a corrupt one), and the record holds the images' byte ranges and, with
``labels``, their ``.cls`` labels.  A sample without a usable image is skipped and listed, or
stops the run, like any bad image.  The merge is make-shards' own (``data_pipeline.ingest.shard_merge``);
the manifest names the tars relative to ``OUT``, so move the two together.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from data_pipeline.ingest.ingest_state import IngestPlan, Part, ShardRecord, save_record
from data_pipeline.ingest.parallel_ingest import open_target, run_ingest
from data_pipeline.ingest.shard_writer import BadImageError
from data_pipeline.shardset.manifest import ShardManifest
from data_pipeline.shardset.table_file import MAX_IMAGE_BYTES, empty_rows, sha256_of
from data_pipeline.shardset.tar_index import scan_tar, write_dali_index
from data_pipeline.shardset.tar_labels import IMAGE_EXTENSIONS, LABEL_EXTENSION, image_component, parse_label
from data_pipeline.storage.shard_url import is_s3


@dataclass(frozen=True)
class TarJob:
    out_dir: str
    number: int
    tar: str  # absolute
    index: str  # relative to out_dir
    labels: bool
    image_extensions: tuple[str, ...]
    on_bad_image: str


def list_tars(root: Path) -> list[str]:
    """``root``-relative paths of the tars under ``root`` (links followed), sorted."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"tar folder {root} does not exist; pass the directory holding the WebDataset tars")
    found = []
    for directory, subdirectories, files in os.walk(root, followlinks=True):
        subdirectories[:] = [name for name in subdirectories if not name.startswith(".")]
        relative = os.path.relpath(directory, root)
        found += [os.path.normpath(os.path.join(relative, name)) for name in files if name.endswith(".tar")]
    if not found:
        raise ValueError(f"{root} holds no .tar files")
    return sorted(found)


def _sample_problem(tar, sample, job: TarJob) -> tuple[object, int, str | None]:
    """``(image component, label, problem)`` of one sample."""
    image = image_component(sample, job.image_extensions)
    if image is None:
        return None, -1, f"has no image component (.{', .'.join(job.image_extensions)})"
    if image.size > MAX_IMAGE_BYTES:
        return None, -1, f"image is {image.size} bytes, more than a sample table row holds"
    label = -1
    if job.labels:
        component = sample.find(LABEL_EXTENSION)
        if component is None:
            return None, -1, f"has no .{LABEL_EXTENSION} component (asked for with --labels cls)"
        tar.seek(component.offset)
        try:
            label = parse_label(tar.read(component.size))
        except ValueError as error:
            return None, -1, str(error)
    tar.seek(image.offset)
    try:
        with Image.open(io.BytesIO(tar.read(image.size))) as decoded:
            decoded.load()
    except Exception as error:  # PIL raises many types for bad data
        return None, -1, f"image does not decode ({type(error).__name__}: {error})"
    return image, label, None


def index_tar(job: TarJob) -> int:
    """Index one tar in place and write its record; returns how many samples it contributes."""
    out_dir = Path(job.out_dir)
    samples = scan_tar(Path(job.tar))
    index_path = out_dir / job.index
    index_path.parent.mkdir(parents=True, exist_ok=True)
    if samples:
        write_dali_index(samples, Path(job.tar), index_path)
    usable, skipped = [], []
    with open(job.tar, "rb") as tar:
        for sample in samples:
            image, label, problem = _sample_problem(tar, sample, job)
            if problem is None:
                usable.append((image, label))
                continue
            origin = f"{job.tar} key {sample.key}"
            if job.on_bad_image == "error":
                raise BadImageError(f"{origin} {problem}; fix the tar and run again (the finished tars are kept), "
                                    "or rerun with --on-bad-image skip")
            skipped.append({"origin": origin, "reason": problem})
    rows = empty_rows(len(usable))
    rows["offset"] = [image.offset for image, _ in usable]
    rows["size"] = [image.size for image, _ in usable]
    rows["label"] = [label for _, label in usable]
    tar_relative = os.path.relpath(job.tar, out_dir)
    record = ShardRecord(number=job.number, tar=tar_relative if usable else None,
                         index=job.index if usable else None, count=len(usable),
                         sha256=sha256_of(Path(job.tar)) if usable else None,
                         tar_bytes=os.path.getsize(job.tar) if usable else 0, skipped=skipped)
    save_record(out_dir, record, rows)
    return len(usable)


def index_tars(root: Path, out_dir: Path, labels: bool = False, image_extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
               on_bad_image: str = "error", workers: int = 0, progress: bool = True,
               part: Part = Part()) -> ShardManifest | None:
    """Index the tars under ``root`` into a shard set in ``out_dir`` (see the module docstring)."""
    if is_s3(out_dir):
        raise ValueError(f"--out {out_dir}: --source tars indexes the tars where they are, so the set's files must "
                         "lie beside them; index them on disk (--out beside --root), then copy the tars' folder and "
                         "--out to S3 together, keeping their relative layout")
    root, out_dir = Path(root).resolve(), Path(out_dir)
    target = open_target(out_dir)
    if on_bad_image not in ("error", "skip"):
        raise ValueError(f"--on-bad-image {on_bad_image!r}: choose 'error' or 'skip'")
    unknown = [extension for extension in image_extensions if extension not in IMAGE_EXTENSIONS]
    if unknown or not image_extensions:
        raise ValueError(f"--image-ext {','.join(image_extensions)}: choose from {','.join(IMAGE_EXTENSIONS)}")
    tars = list_tars(root)
    sizes = [os.path.getsize(root / tar) for tar in tars]
    digest = hashlib.sha256()
    for tar, size in zip(tars, sizes):
        digest.update(f"{tar}\t{size}\n".encode("utf-8", "surrogateescape"))
    plan = IngestPlan(kind="tars", source=f"tars:{root}", listing_sha256=digest.hexdigest(), count=len(tars),
                      num_shards=len(tars), class_names=None,
                      settings={"labels": labels, "image_extensions": list(image_extensions)})

    def make_job(number: int) -> TarJob:
        return TarJob(str(out_dir), number, str(root / tars[number]), tars[number][:-len(".tar")] + ".idx", labels,
                      tuple(image_extensions), on_bad_image)

    return run_ingest(target, plan, part, make_job, index_tar, weight=lambda number: sizes[number], unit="B",
                      workers=workers, progress=progress, shard_names=lambda number: tars[number][:-len(".tar")])
