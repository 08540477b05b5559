"""The JSON manifest that describes a shard set: what the loaders and the validator trust.

Format 2 (``instcls-shards/2``) names the sample table (``data_pipeline.shardset.table_file``): instance id
i is row i of that table, which says where the sample's image lies.  Shards hold ids
``first_id .. first_id + count - 1`` in their manifest order.  The keys inside the tars are not
ids (tars indexed in place keep their own keys); make-shards writes the sample's position in the
seeded order, which equals its id when no image was skipped.

Format 1 (``instcls-shards/1``, before the table existed) is still read: its keys are the ids, and
``data_pipeline.shardset.sample_table`` builds the table from the ``.idx`` files in memory until
``instcls upgrade-shards`` writes it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer.temp_files import temp_sibling

FORMAT = "instcls-shards/2"
LEGACY_FORMAT = "instcls-shards/1"
MANIFEST_NAME = "manifest.json"
SKIPPED_REPORT = "skipped.jsonl"  # the images an ingest skipped, one JSON line each, beside the manifest


@dataclass(frozen=True)
class ShardEntry:
    """One tar file: ``count`` samples with instance ids ``first_id .. first_id + count - 1``.
    ``tar`` and ``index`` are relative to the manifest's directory (a tar indexed in place may lie
    elsewhere, ``../tars/x.tar``)."""

    tar: str
    index: str
    count: int
    first_id: int
    sha256: str


@dataclass
class ShardManifest:
    """Attributes beyond the shards: ``table``/``table_sha256`` the sample table file (format 2);
    ``skipped`` the unusable images of a format-1 set (format 2 lists them in ``skipped_report``,
    one JSON object a line, and counts them in ``num_skipped``); ``listing_sha256`` a digest of the
    source's listing, the same for the same inputs."""

    num_instances: int
    shards: list[ShardEntry]
    source: str
    class_names: list[str] | None = None
    skipped: list[dict] = field(default_factory=list)
    format: str = FORMAT
    table: str | None = None
    table_sha256: str | None = None
    num_skipped: int = 0
    skipped_report: str | None = None
    listing_sha256: str | None = None

    @property
    def legacy(self) -> bool:
        return self.format == LEGACY_FORMAT

    def save(self, directory: Path) -> Path:
        """Write ``manifest.json`` atomically (a reader never sees half a manifest)."""
        path = Path(directory) / MANIFEST_NAME
        tmp = temp_sibling(path)
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory: Path) -> "ShardManifest":
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found; create the shards with `instcls make-shards --out {directory}` "
                "(an interrupted run leaves no manifest: run it again, it resumes)"
            )
        return cls.parse(path.read_text(), str(path), str(directory))

    @classmethod
    def parse(cls, text: str, where: str, directory: str) -> "ShardManifest":
        """The manifest in ``text``; ``where`` names the file and ``directory`` the set in the errors."""
        try:
            raw = json.loads(text)
            if raw.get("format") not in (FORMAT, LEGACY_FORMAT):
                raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT!r} or {LEGACY_FORMAT!r}")
            raw["shards"] = [ShardEntry(**entry) for entry in raw["shards"]]
            manifest = cls(**raw)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ValueError(
                f"{where} is not a valid instcls manifest ({error}); recreate it with make-shards"
            ) from error
        if not manifest.legacy and manifest.table is None:
            raise ValueError(f"{where} names no sample table; rebuild it with `instcls merge-shards {directory}`")
        return manifest

    def tar_paths(self, directory: Path) -> list[str]:
        return [str(Path(directory) / shard.tar) for shard in self.shards]

    def index_paths(self, directory: Path) -> list[str]:
        return [str(Path(directory) / shard.index) for shard in self.shards]
