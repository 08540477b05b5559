"""`instcls bench step`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class StepBenchSettings:
    """Attributes:
    config: the job config whose step is measured.
    ranks: local processes (one per GPU on a GPU node; CPU ranks otherwise).
    steps: measured steps per rank.
    warmup: steps run first and not measured (start-up, allocator, cuDNN's algorithm search, compiles).
    shards: a shard directory to read (default: synthetic shards of synthetic_count images at
        image_size pixels, written to a temporary directory).  With data synthetic the trainer still
        reads its size and its start-up passes (e.g. the contrastive prior) read it.
    synthetic_count: images in the synthetic shards (0: one epoch covers every step the bench runs).
    image_size: side of the synthetic images on disk.
    loader_only: measure the loader alone and stop.
    data: where the step's batches come from: synthetic (one random batch made once on the device,
        handed over at every step: the step alone) or loader (the job's loader over the shards, as
        training reads them; the loader is also measured alone).
    baseline: also run the job's network in a plain PyTorch loop on the same ranks and batch
        (DistributedDataParallel, torch's foreach/fused optimizer kernels, no classifier: a stand-in
        loss) and report the job's images/s over its.
    """

    config: Path = Path("configs/demo_cpu.yaml")
    ranks: int = 2
    steps: int = 20
    warmup: int = 5
    shards: Path | None = None
    synthetic_count: int = 0
    image_size: int = 64
    loader_only: bool = False
    data: Literal["synthetic", "loader"] = "synthetic"
    baseline: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps={self.steps} and warmup={self.warmup}: measure at least one step (--steps 1) "
                             "after zero or more warm-up steps")

    @property
    def measured(self) -> slice:
        return slice(self.warmup, self.warmup + self.steps)
