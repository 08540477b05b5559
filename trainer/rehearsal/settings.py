"""What one rehearsal runs, and where each stage puts its files under the work directory."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMAGENET_1K_TRAIN_IMAGES = 1_281_167
DEFAULT_CONFIG = REPO / "configs" / "rehearsal_in1k_cpu.yaml"


@dataclass(frozen=True)
class RehearsalSettings:
    """Attributes:
    work_dir: everything the rehearsal writes (shards, checkpoints, logs, each node's directory, the report).
    images: N, the synthetic training images (and so the classifier's rows).
    image_size: their side in pixels.
    ingest_parts: `make-shards --part I/K` processes run side by side, as the k8s overlay's Indexed Job.
    steps: training steps of the 2-node job (the last one is saved while the job waits).
    checkpoint_step: the asynchronous save the rehearsal times (``checkpoint.every_steps``).
    batch_per_rank: images per rank on the 2 nodes; the 3-rank resume keeps the global batch, so the
        sampler continues with exactly the samples the 2-rank job would have read.
    resume_ranks, resume_steps: the resumed job's world size and the steps it trains.
    contrastive_prior: run the paper's prior (one no-grad pass over all N images before step 1).
    knn_bank_renders: digit scenes drawn per training digit for the labelled kNN bank.
    config: the job config every stage starts from (paths are overridden to live under work_dir).
    """

    work_dir: Path
    images: int = IMAGENET_1K_TRAIN_IMAGES
    image_size: int = 32
    ingest_parts: int = 2
    steps: int = 300
    checkpoint_step: int = 200
    batch_per_rank: int = 48
    resume_ranks: int = 3
    resume_steps: int = 10
    contrastive_prior: bool = True
    knn_bank_renders: int = 4
    config: Path = DEFAULT_CONFIG

    def __post_init__(self) -> None:
        global_batch = 2 * self.batch_per_rank
        checks = [
            (self.images >= 2 * global_batch, "--images", f"use at least two global batches ({2 * global_batch})"),
            (self.ingest_parts >= 1, "--ingest-parts", "use at least 1 part"),
            (0 < self.checkpoint_step < self.steps, "--checkpoint-step", "use a step before the last (--steps)"),
            (global_batch % self.resume_ranks == 0, "--resume-ranks",
             f"use a world size that divides the global batch {global_batch}, so the resumed job reads the same "
             "samples"),
            (self.resume_steps >= 1, "--resume-steps", "train at least 1 step after the resume"),
        ]
        for ok, flag, fix in checks:
            if not ok:
                raise ValueError(f"{flag}: {fix}")

    # -- the job ------------------------------------------------------------------------------

    @property
    def global_batch(self) -> int:
        return 2 * self.batch_per_rank

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.images / self.global_batch)  # the sampler pads the last step

    @property
    def epochs(self) -> int:
        """Enough epochs for every step of both jobs (1 at N = 1.28M; more for a smoke run's small N)."""
        return math.ceil((self.steps + self.resume_steps) / self.steps_per_epoch)

    # -- the files ----------------------------------------------------------------------------

    @property
    def train_shards(self) -> Path:
        return self.work_dir / "shards" / "train"

    @property
    def knn_bank_shards(self) -> Path:
        return self.work_dir / "shards" / "knn-bank"

    @property
    def knn_query_shards(self) -> Path:
        return self.work_dir / "shards" / "knn-queries"

    @property
    def two_rank_checkpoints(self) -> Path:
        return self.work_dir / "checkpoints" / "2-ranks"

    @property
    def resumed_checkpoints(self) -> Path:
        # Apart from the 2-rank ones: the resumed job's own save (and keep_last) never removes the
        # checkpoint it started from, so its stage can run again.
        return self.work_dir / "checkpoints" / f"{self.resume_ranks}-ranks"

    def logs(self, stage: str) -> Path:
        return self.work_dir / "logs" / stage

    def node_directory(self, stage: str, node: int) -> Path:
        return self.work_dir / "nodes" / stage / f"node-{node}"

    @property
    def command_output(self) -> Path:
        """What each command printed, one file per command."""
        return self.work_dir / "output"

    @property
    def stage_results(self) -> Path:
        return self.work_dir / "stages"

    def job_overrides(self) -> list[str]:
        """``--set`` values every job of the rehearsal shares: its data, an epoch count that covers
        every step, and no progress lines (the driver reads the JSON logs)."""
        return [
            f"data.train_shards={self.train_shards}",
            f"data.knn_bank_shards={self.knn_bank_shards}",
            f"data.eval_shards={self.knn_query_shards}",
            f"optim.epochs={self.epochs}",
            f"objective.contrastive_prior={str(self.contrastive_prior).lower()}",
            "logging.progress=false",
        ]
