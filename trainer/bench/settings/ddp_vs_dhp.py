"""`instcls bench ddp-vs-dhp`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from trainer.bench.settings.float_dtypes import FloatDtype
from trainer.bench.settings.torch_peer import DEFAULT_TORCH_SETTINGS, torch_settings_fix

if TYPE_CHECKING:
    from trainer.bench.step_runner import StepSpec


@dataclass(frozen=True)
class SweepSettings:
    """Attributes:
    ranks: T processes.
    batch: global batch.
    dim: feature dim D.
    chunk_size: classes per chunk.
    logits_cache_bytes: logits cache budget per rank (0 recomputes the logits in the backward).
    cap_gib: memory cap per rank (GiB).
    start_classes: the sweep's first N.
    growth: factor from one N to the next until an allocation fails.
    refine_steps: bisection steps between the last fit and the first failure.
    max_classes: the sweep stops here if nothing failed.
    steps: timed steps per point.
    warmup: untimed steps per point.
    dtype: element type of the features, W and the logits.
    update_in_backward: DHP applies SGD inside the backward (W's gradient never materialised).
    backbone: add a real backbone's forward and backward on random images.
    image_size: side of the backbone's random images.
    ddp_baseline: DDP's code: 'best' (the faster of instcls's replicated classifier and torch's
        linear_cross_entropy under the cap at each N, named in the table; without --backbone) or 'instcls'.
    torch_settings: with ddp_baseline best, the settings of torch's linear_cross_entropy tried, comma-separated:
        'reference' (options=None), 'auto' (torch's own chunk size) or a batch_chunk_size.
    """

    ranks: int = 2
    batch: int = 256
    dim: int = 128
    chunk_size: int = 65536
    logits_cache_bytes: int = 0
    cap_gib: float = 2.0
    start_classes: int = 100_000
    growth: float = 2.0
    refine_steps: int = 4
    max_classes: int = 2_000_000_000
    steps: int = 1
    warmup: int = 1
    dtype: FloatDtype = "float32"
    update_in_backward: bool = False
    backbone: Literal["resnet18", "resnet50"] | None = None
    image_size: int = 64
    ddp_baseline: Literal["best", "instcls"] = "best"
    torch_settings: tuple[str, ...] = DEFAULT_TORCH_SETTINGS

    def __post_init__(self) -> None:
        fix = torch_settings_fix(self.torch_settings)
        if fix:
            raise ValueError(f"--torch-settings {','.join(self.torch_settings)} is invalid: {fix}")

    @property
    def torch_baseline(self) -> bool:
        """Whether DDP's points also time torch's op (the classifier alone: not with a backbone)."""
        return self.ddp_baseline == "best" and self.backbone is None

    def spec(self, mode: str, num_classes: int) -> StepSpec:
        from trainer.bench.step_runner import StepSpec  # torch: imported when a point runs

        return StepSpec(num_classes=num_classes, batch=self.batch, dim=self.dim, chunk_size=self.chunk_size,
                        mode=mode, logits_cache_bytes=self.logits_cache_bytes, dtype=self.dtype, steps=self.steps,
                        warmup=self.warmup, update_in_backward=self.update_in_backward and mode == "dhp",
                        backbone=self.backbone, image_size=self.image_size)
