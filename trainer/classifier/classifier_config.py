"""Settings of the cosine classifier, declared and checked once.

``HeadSettings`` are what every objective built on the sharded cosine head has (``pic`` uses only
these); ``ClassifierSettings`` add the full classifier's (``instance`` is configured by them);
``ClassifierConfig`` adds what the data and the job decide (N, D, the seed).  Objective configs
inherit the settings, so a field is declared, documented and checked in one place, and the YAML
stays flat (``objective.temperature``, ``objective.top_k``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from data_pipeline.contract import ViewLayout
from trainer.checks import raise_first_invalid
from trainer.classifier.kernel.chunked import IMPLEMENTATIONS, MAX_ABS_LOGIT, KernelSettings
from trainer.classifier.kernel.losses import SmoothingForm
from trainer.classifier.terms import active_term
from trainer.classifier.terms.chunk_term import ChunkTerm

MODES = ("dhp", "ddp")


def _temperature_fix(usual: str) -> str:
    return (f"use a temperature >= {1 / MAX_ABS_LOGIT} ({usual}); the kernel exponentiates cosine logits up to "
            "1/temperature without a running max")


@dataclass(frozen=True)
class HeadSettings:
    """Attributes:
    temperature: tau of the cosine softmax (instance paper: 0.15; PIC: 0.2).
    chunk_size: rows scored at once; activation memory is O(batch * chunk_size).
    init_std: std of the Gaussian initial rows (the same rows under any sharding).
    co2_alpha: weight of CO2's consistency term between the global views' similarity
        distributions over the other rows (``trainer.classifier.terms.co2``); 0 is off, CO2's
        MoCo v2 setting is 0.3.  Needs at least two global views per image.
    co2_temperature: tau_con of that term (CO2's MoCo v2 setting: 0.05).
    kernel: "auto" (the fused Triton kernels on GPUs, the chunked loop on CPUs and whenever a term
        such as CO2 rides along), or "chunked" / "fused" to force one (docs/benchmarks.md).
    """

    temperature: float = 0.15
    chunk_size: int = 65536
    init_std: float = 0.01
    co2_alpha: float = 0.0
    co2_temperature: float = 0.05
    kernel: str = "auto"

    USUAL_TEMPERATURE: ClassVar[str] = "paper: 0.15"  # named in the fix of a bad temperature

    def __post_init__(self) -> None:
        raise_first_invalid(self, self.checks())

    def checks(self) -> list[tuple[bool, str, str]]:
        """``(ok, field, fix)`` of every field; subclasses add theirs."""
        return [
            (self.temperature >= 1 / MAX_ABS_LOGIT, "temperature", _temperature_fix(self.USUAL_TEMPERATURE)),
            (self.chunk_size >= 1, "chunk_size", "use a positive number of rows per chunk (e.g. 65536)"),
            (self.init_std > 0, "init_std", "use a positive standard deviation (e.g. 0.01)"),
            (self.co2_alpha >= 0, "co2_alpha", "use alpha >= 0 (0: off; CO2's MoCo v2 setting: 0.3)"),
            (self.co2_temperature >= 1 / MAX_ABS_LOGIT, "co2_temperature",
             _temperature_fix("CO2's MoCo v2 setting: 0.05")),
            (self.kernel in IMPLEMENTATIONS, "kernel", f"choose one of {IMPLEMENTATIONS} (auto: fused on GPUs)"),
            (not (self.kernel == "fused" and self.co2_alpha > 0), "kernel",
             "use kernel: auto or chunked with co2_alpha > 0 (CO2's term runs in the chunked loop)"),
        ]

    def kernel_settings(self) -> KernelSettings:
        return KernelSettings(temperature=self.temperature, chunk_size=self.chunk_size, implementation=self.kernel)

    def kernel_choice(self, views: ViewLayout, device: torch.device) -> str:
        """The start-up line's words for the path the classifier runs on ``device``, and why."""
        has_term = self.term(views) is not None
        path = self.kernel_settings().resolved_implementation(device, has_term)
        if path == "fused":
            return "classifier kernel: fused (Triton; logits stay on the chip)"
        why = ("kernel: chunked" if self.kernel == "chunked" else "CO2's term runs in it" if has_term
               else f"{device.type} tensors")
        return f"classifier kernel: chunked ({why})"

    def term(self, views: ViewLayout) -> ChunkTerm | None:
        """The per-sample term fused into the kernel for a batch of these views (None: none): the
        registered term these settings turn on (``trainer.classifier.terms``)."""
        return active_term(self, views)


@dataclass(frozen=True)
class ClassifierSettings(HeadSettings):
    """Attributes (besides ``HeadSettings``'):
    mode: "dhp" shards W by class range over the classifier group (the method); "ddp" replicates
        it on every rank and all-reduces its N x D gradient (the baseline it beats).
    smoothing_alpha: alpha of the top-K hardest label smoothing; 0 turns it (and its search) off.
    top_k: K hard negatives per instance (paper: 100); at most N - 1.
    smoothing_form: "paper" (Eq. 3, weights inside the log) or "soft_target" (-sum y log p); see
        ``trainer.classifier.kernel.losses``.
    logits_cache_bytes: keep the forward's chunk logits for the backward when they fit in this
        many bytes per rank (one matmul fewer per step); 0 recomputes them.
    """

    mode: str = "dhp"
    smoothing_alpha: float = 0.0
    top_k: int = 100
    smoothing_form: str = "paper"
    logits_cache_bytes: int = 0

    def checks(self) -> list[tuple[bool, str, str]]:
        forms = tuple(form.value for form in SmoothingForm)
        return [
            *super().checks(),
            (self.mode in MODES, "mode", f"choose one of {MODES}"),
            (0 <= self.smoothing_alpha < 1, "smoothing_alpha", "use 0 <= alpha < 1 (paper: 0.2)"),
            (self.top_k >= 1, "top_k", "use K >= 1 hard negatives per instance (paper: 100), or smoothing_alpha: 0"),
            (self.smoothing_form in forms, "smoothing_form", f"choose one of {forms}"),
            (self.logits_cache_bytes >= 0, "logits_cache_bytes", "use 0 (recompute) or a byte budget"),
        ]

    def kernel_settings(self) -> KernelSettings:
        return KernelSettings(temperature=self.temperature, chunk_size=self.chunk_size, form=self.smoothing_form,
                              logits_cache_bytes=self.logits_cache_bytes, implementation=self.kernel)


@dataclass(frozen=True)
class ClassifierConfig(ClassifierSettings):
    """The N-way instance classifier of one job (``ClassifierSettings`` plus what the job decides).

    Attributes:
        num_classes: N, the number of instances (one class each).
        feature_dim: D, the width of the projection head's output.
        init_seed: seed of the initial weights; rows depend only on (seed, global row), so the
            same seed gives the same W under any sharding.
        validate_inputs: check ids, shapes and equal batch sizes on every call (costs a host
            sync and one tiny all-reduce; a trainer may disable it after the first steps).
        backbone_grads_averaged: the gradient sent back to the features assumes the backbone's
            gradients are then *averaged* over all data-parallel ranks (DeepSpeed, DDP).  In DHP
            mode the feature gradient is multiplied by the classifier group size so that this
            average equals the exact gradient of the global-batch mean loss.  Set False if the
            caller sums backbone gradients instead.
        field_prefix: what a bad field's error names it by (``objective.`` when an objective's
            settings built it).
    """

    num_classes: int = field(kw_only=True)
    feature_dim: int = 128
    init_seed: int = 0
    validate_inputs: bool = True
    backbone_grads_averaged: bool = True
    field_prefix: str = field(default="classifier.", kw_only=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        raise_first_invalid(self, self.checks(), self.field_prefix)

    @classmethod
    def of(cls, settings: ClassifierSettings, **job) -> ClassifierConfig:
        """The classifier configured by an objective's ``settings`` plus the job's fields (``job``)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(ClassifierSettings)}, **job,
                   field_prefix="objective.")

    def checks(self) -> list[tuple[bool, str, str]]:
        return [
            (self.num_classes >= 2, "num_classes", "an instance classifier needs at least 2 instances"),
            (self.feature_dim >= 1, "feature_dim", "set it to the projection head's output width (e.g. 128)"),
            *super().checks(),
            (self.smoothing_alpha == 0 or self.top_k <= self.num_classes - 1, "top_k",
             f"K must be at most num_classes - 1 = {self.num_classes - 1} (an instance has that many other "
             "classes in this data set); lower it or set smoothing_alpha: 0"),
        ]
