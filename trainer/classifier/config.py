"""Settings of the instance classifier; every field is checked with a message that names the fix."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.classifier.kernel import MAX_ABS_LOGIT
from trainer.classifier.losses import SmoothingForm

MODES = ("dhp", "ddp")


def co2_checks(config) -> list[tuple[bool, str, str]]:
    """``(ok, field, fix)`` for the ``co2_alpha`` / ``co2_temperature`` fields of ``config``."""
    return [
        (config.co2_alpha >= 0, "co2_alpha", "use alpha >= 0 (0: off; CO2's MoCo v2 setting: 0.3)"),
        (config.co2_temperature >= 1 / MAX_ABS_LOGIT, "co2_temperature",
         f"use a temperature >= {1 / MAX_ABS_LOGIT} (CO2's MoCo v2 setting: 0.05); the kernel exponentiates "
         "cosine logits up to 1/temperature without a running max"),
    ]


@dataclass
class ClassifierConfig:
    """The N-way cosine-softmax instance classifier.

    Attributes:
        num_classes: N, the number of instances (one class each).
        feature_dim: D, the width of the projection head's output.
        temperature: tau of the cosine softmax (the paper uses 0.15).
        chunk_size: classes scored at once; activation memory is O(batch * chunk_size).
        mode: "dhp" shards W by class range over the classifier group and all-gathers features;
            "ddp" is the baseline: full W on every rank, local batch, W's gradient all-reduced.
        smoothing_alpha: alpha of the top-K hardest label smoothing; 0 disables it.
        smoothing_top_k: K, hard negatives per instance (the paper uses 100).
        smoothing_form: "paper" (Eq. 3, weights inside the log) or "soft_target" (the usual
            -sum y log p); see ``trainer.classifier.losses``.
        init_std: standard deviation of the Gaussian initial weights.
        init_seed: seed of the initial weights; rows depend only on (seed, global row), so the
            same seed gives the same W under any sharding.
        co2_alpha: weight of CO2's consistency term (``trainer.classifier.consistency``); 0 is off,
            CO2's MoCo v2 setting is 0.3.  Needs at least two global views per image.
        co2_temperature: tau_con of the term's two distributions (CO2's MoCo v2 setting: 0.05).
        logits_cache_bytes: keep the chunk logits of the forward for the backward when they fit in
            this many bytes per rank, instead of recomputing them (one matmul fewer per step);
            0 always recomputes.
        validate_inputs: check ids, shapes and equal batch sizes on every call (costs a host
            sync and one tiny all-reduce; a trainer may disable it after the first steps).
        backbone_grads_averaged: the gradient sent back to the features assumes the backbone's
            gradients are then *averaged* over all data-parallel ranks (DeepSpeed, DDP).  In DHP
            mode the feature gradient is multiplied by the classifier group size so that this
            average equals the exact gradient of the global-batch mean loss.  Set False if the
            caller sums backbone gradients instead.
    """

    num_classes: int
    feature_dim: int = 128
    temperature: float = 0.15
    chunk_size: int = 65536
    mode: str = "dhp"
    smoothing_alpha: float = 0.0
    smoothing_top_k: int = 100
    smoothing_form: str = "paper"
    init_std: float = 0.01
    init_seed: int = 0
    co2_alpha: float = 0.0
    co2_temperature: float = 0.05
    logits_cache_bytes: int = 0
    validate_inputs: bool = True
    backbone_grads_averaged: bool = True

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"classifier.{field}={getattr(self, field)!r} is invalid: {fix}")

        need(self.num_classes >= 2, "num_classes", "an instance classifier needs at least 2 instances")
        need(self.feature_dim >= 1, "feature_dim", "set it to the projection head's output width (e.g. 128)")
        need(self.temperature >= 1 / MAX_ABS_LOGIT, "temperature",
             f"use a temperature >= {1 / MAX_ABS_LOGIT} (the paper uses 0.15): the kernel exponentiates cosine "
             "logits up to 1/temperature without a running max")
        need(self.chunk_size >= 1, "chunk_size", "use a positive number of classes per chunk (e.g. 65536)")
        need(self.mode in MODES, "mode", f"choose one of {MODES}")
        need(0.0 <= self.smoothing_alpha < 1.0, "smoothing_alpha", "use 0 <= alpha < 1 (the paper uses 0.2)")
        need(
            self.smoothing_top_k >= 1,
            "smoothing_top_k",
            "use K >= 1 hard negatives per instance (the paper uses 100), or smoothing_alpha=0",
        )
        need(
            self.smoothing_alpha == 0 or self.smoothing_top_k <= self.num_classes - 1,
            "smoothing_top_k",
            f"K must be at most num_classes - 1 = {self.num_classes - 1} (an instance has that many "
            "other classes); lower K or set smoothing_alpha=0",
        )
        valid_forms = tuple(form.value for form in SmoothingForm)
        need(self.smoothing_form in valid_forms, "smoothing_form", f"choose one of {valid_forms}")
        need(self.init_std > 0, "init_std", "use a positive standard deviation (e.g. 0.01)")
        for ok, field, fix in co2_checks(self):
            need(ok, field, fix)
        need(self.logits_cache_bytes >= 0, "logits_cache_bytes", "use 0 (recompute) or a byte budget")

    @property
    def form(self) -> SmoothingForm:
        return SmoothingForm(self.smoothing_form)
