"""How a loader reads a shard set: ``LoaderConfig``, shared by the trainer, both loader backends
and the benchmarks (kept apart from the loaders so that every import goes one way)."""

from __future__ import annotations

from dataclasses import dataclass, field

from data_pipeline.augment import AugmentConfig

LOADER_BACKENDS = ("dali", "torch")
LAST_BATCH_POLICIES = ("pad", "drop")


@dataclass(frozen=True)
class LoaderConfig:
    """Attributes:
    batch_size: samples per rank per step.
    backend: "dali" (nvJPEG decode on the GPU when CUDA is present, else DALI on the CPU) or
        "torch" (PIL + torchvision in DataLoader workers, the fallback and speed baseline).
    num_threads: DALI CPU threads (and file-reading threads), or DataLoader worker processes.
    last_batch: "pad" or "drop" for training, see ``data_pipeline.sampler``; evaluation always pads.
    seed: base seed of the epoch orders and of every augmentation parameter.
    augment: the augmentation recipe.
    """

    batch_size: int = 256
    backend: str = "dali"
    num_threads: int = 4
    last_batch: str = "pad"
    seed: int = 0
    augment: AugmentConfig = field(default_factory=AugmentConfig)

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {fix}")

        need(self.batch_size >= 1, "batch_size", "use at least 1 sample per rank")
        need(self.backend in LOADER_BACKENDS, "backend", f"choose one of {LOADER_BACKENDS}")
        need(self.num_threads >= 1, "num_threads", "use at least 1")
        need(self.last_batch in LAST_BATCH_POLICIES, "last_batch", f"choose one of {LAST_BATCH_POLICIES}")
