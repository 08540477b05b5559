"""How `instcls make-shards` writes its shards, checked when made; a module of its own, without the
writer's imports (webdataset loads torch), so that the command line builds its options from the
defaults before anything heavy loads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardSettings:
    prefix: str = "shard"
    samples_per_shard: int = 1000
    on_bad_image: str = "error"  # or "skip"
    seed: int = 0
    workers: int = 0  # processes that check/encode images; 0: every CPU this process may use
    max_side: int | None = None  # shrink larger images so their longer side is this (None: keep)

    def __post_init__(self) -> None:
        if self.samples_per_shard < 1:
            raise ValueError(f"--samples-per-shard {self.samples_per_shard}: use at least 1")
        if self.on_bad_image not in ("error", "skip"):
            raise ValueError(f"--on-bad-image {self.on_bad_image!r}: choose 'error' or 'skip'")
        if "/" in self.prefix or not self.prefix:
            raise ValueError(f"--prefix {self.prefix!r}: use a plain file-name prefix such as 'imagenet-train'")
        if self.max_side is not None and self.max_side < 8:
            raise ValueError(f"--max-side {self.max_side}: use at least 8 pixels (or leave it out)")
