"""How a loader reads a shard set: ``LoaderConfig``, shared by the trainer, both loader backends
and the benchmarks (kept apart from the loaders so that every import goes one way)."""

from __future__ import annotations

from dataclasses import dataclass, field

from data_pipeline.loading.augment.augment_config import AugmentConfig
from data_pipeline.loading.samplers import sampler_kinds
from data_pipeline.loading.samplers.base import LAST_BATCH_POLICIES
from data_pipeline.loading.view_layout import ViewLayout

LOADER_BACKENDS = ("dali", "torch")
BAD_SAMPLE_POLICIES = ("stop", "skip")


@dataclass(frozen=True)
class SamplerConfig:
    """Which ids the training steps read (evaluation always reads the stored order).  Attributes:
    kind: a registered sampler (``data_pipeline.loading.samplers``): "epoch_permutation" (a seeded
        permutation per epoch, ``samplers/epoch_permutation.py``) or "sliding_window" (PIC's
        Algorithm 3, ``samplers/sliding_window.py``).
    window_size: ids per sliding window W; 0 picks min(2**17, max(global batch, 2**round(log2(N/10)))).
    stride: ids the window moves by S, at most window_size; 0 picks max(1, W // 8) (87.5% overlap).
        window_size and stride apply to "sliding_window" only.
    """

    kind: str = "epoch_permutation"
    window_size: int = 0
    stride: int = 0

    def __post_init__(self) -> None:
        if self.kind not in sampler_kinds():  # the registry of data_pipeline.loading.samplers
            raise ValueError(f"kind={self.kind!r} is invalid: choose one of {sampler_kinds()}")
        for name in ("window_size", "stride"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: use 0 (auto) or a positive size")
        if 0 < self.window_size < self.stride:  # with an auto size the sampler checks once W is known
            raise ValueError(f"stride={self.stride!r} is invalid: use at most window_size={self.window_size}, "
                             "or ids between windows are never read")


@dataclass(frozen=True)
class LoaderConfig:
    """Attributes:
    batch_size: samples per rank per step.
    backend: "dali" (nvJPEG decode on the GPU when CUDA is present, else DALI on the CPU) or
        "torch" (PIL + torchvision in DataLoader workers, the fallback and speed baseline).
    num_threads: DALI CPU threads (and file-reading threads), or DataLoader worker processes.
    prefetch_depth: batches DALI prepares ahead (its ``prefetch_queue_depth``): the one the step
        trains on and those decoded meanwhile.  2 covers one step when a batch decodes faster than a
        step trains, the GPU case (nvJPEG); each one more holds another batch of views on the device
        (``instcls plan`` counts them).  The files are read 3 steps ahead regardless.
    last_batch: "pad" or "drop" for training with the epoch_permutation sampler, see
        ``data_pipeline.loading.samplers.epoch_permutation``; evaluation always pads, the sliding window never pads.
    seed: base seed of the sample order and of every augmentation parameter.  Unset (default) in a
        job config: the job's top-level ``seed``, so that one seed drives the initial weights, the
        data order and the views (``JobConfig``); a loader built outside a job (benchmarks, the
        selftest) reads 0 (``sample_seed``).  A resumed run keeps the seed its checkpoint's sampler
        recorded.
    augment: the augmentation recipe.
    sampler: which ids the training steps read (see ``SamplerConfig``).
    on_bad_sample: a sample whose bytes cannot be read, are not an image, or do not decode past the
        header (a shard damaged after validation): "stop" the job with its shard and key (default;
        exit 2), or "skip" it: it is read as a blank image and weighs zero in its step (marked not
        valid, so no objective state is written for it), a warning names it and
        ``instcls_bad_samples_skipped_total`` counts it.
    """

    batch_size: int = 256
    backend: str = "dali"
    num_threads: int = 4
    prefetch_depth: int = 2
    last_batch: str = "pad"
    seed: int | None = None
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    on_bad_sample: str = "stop"

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {fix}")

        need(self.batch_size >= 1, "batch_size", "use at least 1 sample per rank")
        need(self.backend in LOADER_BACKENDS, "backend", f"choose one of {LOADER_BACKENDS}")
        need(self.num_threads >= 1, "num_threads", "use at least 1")
        need(self.prefetch_depth >= 1, "prefetch_depth", "use at least 1 (2 overlaps decoding with a step)")
        need(self.last_batch in LAST_BATCH_POLICIES, "last_batch", f"choose one of {LAST_BATCH_POLICIES}")
        need(self.on_bad_sample in BAD_SAMPLE_POLICIES, "on_bad_sample", f"choose one of {BAD_SAMPLE_POLICIES}")
        need(self.seed is None or self.seed >= 0, "seed", "use a non-negative seed, or leave it unset to follow the "
             "job's seed")

    @property
    def sample_seed(self) -> int:
        """The seed the sampler and the augmentation draw from (``seed``; 0 when unset outside a job)."""
        return 0 if self.seed is None else self.seed

    @property
    def view_layout(self) -> ViewLayout:
        """The training views of every step, as the loader emits them and the losses read them."""
        return ViewLayout.of_training(self.augment)
