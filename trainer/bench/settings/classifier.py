"""`instcls bench classifier`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainer.bench.settings.float_dtypes import FLOAT_DTYPES, FloatDtype


def default_chunk_size() -> int:
    """CPU: 2048 classes keep a chunk's ``[chunk, B]`` logits within a core's L2/L3 while its
    elementwise passes run (measured fastest of 512-8192 at B=256); GPU: big chunks fill the SMs."""
    import torch

    return 65536 if torch.cuda.is_available() else 2048


@dataclass(frozen=True)
class ClassifierBenchSettings:
    """Attributes:
    num_classes: N, the classifier's rows.
    batch: global batch B (B / T per rank).
    dim: feature dim D.
    ranks: T processes.
    chunk_size: classes per chunk (default: 2048 on CPU, 65536 on GPUs).
    steps: timed steps.
    warmup: untimed steps before them.
    dtype: element type of the features, W and the logits.
    """

    num_classes: int = 1_000_000
    batch: int = 256
    dim: int = 128
    ranks: int = 2
    chunk_size: int | None = None
    steps: int = 5
    warmup: int = 1
    dtype: FloatDtype = "float32"

    def __post_init__(self) -> None:
        if self.batch % self.ranks:
            raise ValueError(f"--batch {self.batch} must be divisible by --ranks {self.ranks} (equal local batches)")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("--steps must be >= 1 and --warmup >= 0")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose float32, bfloat16 or float16")

    def on_this_machine(self) -> ClassifierBenchSettings:
        """These settings with the chunk size left unset filled in for this machine's device: torch is
        imported here, when the bench runs, not when the command line builds its options."""
        return self if self.chunk_size is not None else dataclasses.replace(self, chunk_size=default_chunk_size())

    def rows_scored(self, mode: str) -> int:
        """Samples each rank scores: the gathered batch (DHP) or its local part (DDP)."""
        return self.batch if mode == "dhp" else self.batch // self.ranks

    def classes_scored(self, mode: str) -> int:
        """Classes held by the largest shard (DHP) or all of them (DDP)."""
        return math.ceil(self.num_classes / self.ranks) if mode == "dhp" else self.num_classes

    def cache_bytes(self, mode: str) -> int:
        """What the logits cache holds on a rank: fp32 ``exp(z)`` of every scored (sample, class)."""
        return self.rows_scored(mode) * self.classes_scored(mode) * 4

    def useful_flops(self, mode: str) -> int:
        """Per rank and step: forward logits, feature gradient, weight gradient."""
        return 6 * self.rows_scored(mode) * self.classes_scored(mode) * self.dim
