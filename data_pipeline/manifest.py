"""The JSON manifest that describes a shard set: what the loaders and the validator trust."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT = "instcls-shards/1"
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class ShardEntry:
    """One tar file: ``count`` samples with instance ids ``first_id .. first_id + count - 1``."""

    tar: str
    index: str
    count: int
    first_id: int
    sha256: str


@dataclass
class ShardManifest:
    num_instances: int
    shards: list[ShardEntry]
    source: str
    class_names: list[str] | None = None
    skipped: list[dict] = field(default_factory=list)
    format: str = FORMAT

    def save(self, directory: Path) -> Path:
        """Write ``manifest.json`` atomically (a reader never sees half a manifest)."""
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory: Path) -> "ShardManifest":
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found; create the shards with `instcls make-shards --out {directory}` "
                "(an interrupted run leaves no manifest: run it again)"
            )
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != FORMAT:
                raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT!r}")
            raw["shards"] = [ShardEntry(**entry) for entry in raw["shards"]]
            return cls(**raw)
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{path} is not a valid instcls manifest ({error}); recreate it with make-shards") from error

    def tar_paths(self, directory: Path) -> list[str]:
        return [str(Path(directory) / shard.tar) for shard in self.shards]

    def index_paths(self, directory: Path) -> list[str]:
        return [str(Path(directory) / shard.index) for shard in self.shards]
