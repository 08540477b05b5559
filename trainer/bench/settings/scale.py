"""`instcls bench scale`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.bench.dataset_sizes import IMAGENET_1K, IMAGENET_21K


@dataclass(frozen=True)
class ScaleBenchSettings:
    """Attributes:
    num_samples: N, instances of the data set (ImageNet-21K: 14,197,122, ``dataset_sizes``).
    compare_samples: a smaller N measured beside it (ImageNet-1K: 1,281,167), for the growth column.
    ranks: T, ranks of the job the per-rank figures are for.
    batch: images per rank per step.
    new_ranks: the world size a checkpoint's classifier rows are re-split to.
    dim: columns of a classifier row in the re-split.
    top_k: hard negatives per instance.
    queue_size: PIC's recent ids K.
    samples_per_shard: shard size of the synthetic sample table.
    steps: steps each per-step item runs (reported per step).
    work_dir: where the synthetic table and checkpoint files go (default: a temporary directory).
    """

    num_samples: int = IMAGENET_21K
    compare_samples: int = IMAGENET_1K
    ranks: int = 64
    batch: int = 64
    new_ranks: int = 48
    dim: int = 128
    top_k: int = 100
    queue_size: int = 65_536
    samples_per_shard: int = 1000
    steps: int = 200
    work_dir: Path | None = None

    def __post_init__(self) -> None:
        problems = [f"--{name.replace('_', '-')} must be >= 1" for name in
                    ("num_samples", "compare_samples", "ranks", "batch", "new_ranks", "dim", "top_k",
                     "samples_per_shard", "steps") if getattr(self, name) < 1]
        if self.num_samples < self.ranks * self.batch or self.compare_samples < self.ranks * self.batch:
            problems.append("--num-samples and --compare-samples must hold one global batch (ranks x batch)")
        if self.top_k >= min(self.num_samples, self.compare_samples):
            problems.append("--top-k must be smaller than the number of samples")
        if problems:
            raise ValueError("bench scale: " + "; ".join(problems))
