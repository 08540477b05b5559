"""`instcls bench checkpoint`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.bench.dataset_sizes import IMAGENET_1K, IMAGENET_21K


@dataclass(frozen=True)
class CheckpointBenchSettings:
    """Attributes:
    datasets: comma-separated class counts N, a column each (ImageNet-21K and ImageNet-1K).
    job_ranks: ranks of the job whose per-rank share each local process holds (N / job_ranks rows).
    dim: feature dim D of a classifier row (saved with its momentum, fp32).
    backbone_params: parameters of the backbone and head (ResNet-50's).
    optimizer_states: fp32 moments per backbone parameter besides its master weight (Adam: 2).
    ranks: local processes saving, as ranks of one job (gloo on CPU, NCCL on GPUs).
    reshard_ranks: local processes loading the checkpoint as a job of another world size.
    saves: timed saves and loads of each kind (the median is reported).
    directory: where the checkpoints go (default: a temporary directory, removed after).
    grace_seconds: the SIGTERM grace period a preemption save must fit in.
    """

    datasets: tuple[str, ...] = (str(IMAGENET_21K), str(IMAGENET_1K))
    job_ranks: int = 64
    dim: int = 128
    backbone_params: int = 25_557_032
    optimizer_states: int = 2
    ranks: int = 2
    reshard_ranks: int = 3
    saves: int = 3
    directory: Path | None = None
    grace_seconds: float = 600.0
