"""`instcls validate-shards`: prove a shard set is safe to train on before a job meets it.

Checks the manifest's checksums and counts, the DALI index files, that every sample has its image,
id and label, that every image decodes, that each shard holds the ids the manifest says, and that
ids over all shards are exactly 0..N-1 once each.  Every problem is reported by shard and key.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass, field
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from data_pipeline.manifest import ShardEntry, ShardManifest
from data_pipeline.shards import decode_int64, sha256_of

REQUIRED_COMPONENTS = ("jpg", "id", "cls")


@dataclass
class ShardReport:
    tar: str
    ids: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _samples(tar_path: Path):
    """``(key, {extension: bytes})`` per sample, in stored order (keys split at the first dot)."""
    with tarfile.open(tar_path) as archive:
        key, components = None, {}
        for member in archive:
            if not member.isfile():
                continue
            base, _, extension = member.name.partition(".")
            if base != key and key is not None:
                yield key, components
                components = {}
            key = base
            components[extension] = archive.extractfile(member).read()
        if key is not None:
            yield key, components


def _sample_problem(components: dict[str, bytes]) -> str | None:
    missing = [c for c in REQUIRED_COMPONENTS if c not in components]
    if missing:
        return f"missing component(s) {', '.join('.' + m for m in missing)}"
    for name in ("id", "cls"):
        try:
            decode_int64(components[name])
        except ValueError as error:
            return f".{name} is not an int64 ({error})"
    try:
        with Image.open(io.BytesIO(components["jpg"])) as image:
            image.load()
    except Exception as error:
        return f"image does not decode ({type(error).__name__}: {error})"
    return None


def check_shard(job: tuple[Path, ShardEntry]) -> ShardReport:
    shard_dir, entry = job
    report = ShardReport(entry.tar)
    tar_path = shard_dir / entry.tar
    if not tar_path.is_file():
        report.problems.append(f"{entry.tar}: file missing (listed in the manifest)")
        return report
    if sha256_of(tar_path) != entry.sha256:
        report.problems.append(f"{entry.tar}: sha256 differs from the manifest (file changed or truncated)")
    index_path = shard_dir / entry.index
    if not index_path.is_file():
        report.problems.append(f"{entry.index}: DALI index missing; recreate the shard set")
    else:
        header = index_path.read_text().split("\n", 1)[0].split()
        if len(header) != 2 or header[1] != str(entry.count):
            report.problems.append(f"{entry.index}: header {' '.join(header)!r} does not list {entry.count} samples")
    try:
        for key, components in _samples(tar_path):
            problem = _sample_problem(components)
            if problem is not None:
                report.problems.append(f"{entry.tar} key {key}: {problem}")
            try:  # a readable id still counts, so a bad image is not also reported as a missing id
                instance_id = decode_int64(components["id"])
            except (KeyError, ValueError):
                continue
            if not entry.first_id <= instance_id < entry.first_id + entry.count:
                report.problems.append(
                    f"{entry.tar} key {key}: id {instance_id} outside this shard's manifest range "
                    f"[{entry.first_id}, {entry.first_id + entry.count})"
                )
            report.ids.append(instance_id)
    except (tarfile.TarError, OSError, EOFError) as error:
        report.problems.append(f"{entry.tar}: unreadable tar after {len(report.ids)} samples ({error})")
    if len(report.ids) != entry.count and not report.problems:
        report.problems.append(f"{entry.tar}: holds {len(report.ids)} samples, the manifest says {entry.count}")
    return report


def validate_shards(shard_dir: Path, workers: int = 2, progress: bool = True) -> tuple[int, list[str]]:
    """``(samples checked, problems)``; no problems means the set is safe to train on."""
    shard_dir = Path(shard_dir)
    manifest = ShardManifest.load(shard_dir)
    problems: list[str] = []
    counts = np.zeros(manifest.num_instances, dtype=np.int64)
    checked = 0
    jobs = [(shard_dir, entry) for entry in manifest.shards]
    with Pool(workers) as pool:
        reports = pool.imap(check_shard, jobs)
        for report in tqdm(reports, total=len(jobs), desc="validate-shards", disable=not progress, unit="shard"):
            problems += report.problems
            checked += len(report.ids)
            ids = np.asarray(report.ids, dtype=np.int64)
            out_of_range = ids[(ids < 0) | (ids >= manifest.num_instances)]
            if out_of_range.size:
                problems.append(f"{report.tar}: ids {out_of_range[:5].tolist()} outside [0, {manifest.num_instances})")
            np.add.at(counts, ids[(ids >= 0) & (ids < manifest.num_instances)], 1)
    duplicated, missing = np.flatnonzero(counts > 1), np.flatnonzero(counts == 0)
    if duplicated.size:
        problems.append(f"{duplicated.size} instance id(s) appear more than once, e.g. {duplicated[:5].tolist()}")
    if missing.size:
        problems.append(f"{missing.size} instance id(s) of 0..{manifest.num_instances - 1} are missing, e.g. {missing[:5].tolist()}")
    return checked, problems
