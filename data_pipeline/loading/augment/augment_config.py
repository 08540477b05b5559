"""The augmentation recipe of the paper (SimCLR-style), shared by the DALI and fallback loaders.

Per view: random resized crop (area scale 0.2-1, aspect 3/4-4/3) -> horizontal flip (p=0.5) ->
colour jitter (brightness, contrast, saturation 0.4, hue 0.1) with p=0.8 -> grayscale p=0.2 ->
Gaussian blur (sigma 0.1-2) with p=0.5 -> normalise with the ImageNet mean/std, CHW float32.
Multi-crop adds ``small_crops`` views of ``small_size`` pixels cut from ``small_scale`` of the area.

Both loaders apply it from parameters drawn in Python (``data_pipeline.loading.augment.view_params``); colour
jitter and grayscale form one affine colour map (``data_pipeline.loading.augment.colour`` gives its exact
semantics), and the blur kernel of a sigma spans ``2*ceil(3*sigma)+1`` pixels (DALI's default).
"""

from __future__ import annotations

from dataclasses import dataclass

CROP_ASPECT = (3 / 4, 4 / 3)  # aspect-ratio range of every random resized crop
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class AugmentConfig:
    """Attributes:
    image_size: side of the global views (224 for ImageNet, 32 for the CPU demo).
    num_views: global views per image (2 in the paper).
    crop_scale: area range of the random resized crop of global views.
    small_crops: extra small views per image (multi-crop; 0 disables it).
    small_size: side of the small views.
    small_scale: area range of the small crops.
    flip_prob: probability of a horizontal flip (0.5; 0 for data where mirroring changes meaning,
        such as digits).
    jitter: colour-jitter strengths (brightness, contrast, saturation, hue), torchvision semantics.
    jitter_prob / grayscale_prob / blur_prob: probabilities of those steps.
    blur_sigma: range of the Gaussian blur's sigma, in pixels.
    eval_resize: inference pipeline resizes the shorter side to image_size * eval_resize, then
        centre-crops image_size (256/224 for ImageNet).
    """

    image_size: int = 224
    num_views: int = 2
    crop_scale: tuple[float, float] = (0.2, 1.0)
    small_crops: int = 0
    small_size: int = 96
    small_scale: tuple[float, float] = (0.05, 0.2)
    flip_prob: float = 0.5
    jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1)
    jitter_prob: float = 0.8
    grayscale_prob: float = 0.2
    blur_prob: float = 0.5
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    eval_resize: float = 256 / 224

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r} is invalid: {fix}")

        need(self.image_size >= 8, "image_size", "use at least 8 pixels")
        need(self.num_views >= 1, "num_views", "use at least 1 view (the paper uses 2)")
        need(self.small_crops >= 0, "small_crops", "use 0 to disable multi-crop, or a positive count")
        need(self.small_size >= 8, "small_size", "use at least 8 pixels")
        for field in ("crop_scale", "small_scale"):
            low, high = getattr(self, field)
            need(0 < low <= high <= 1, field, "use 0 < low <= high <= 1 (fractions of the image area)")
        need(
            all(v >= 0 for v in self.jitter) and self.jitter[3] <= 0.5,
            "jitter",
            "use non-negative strengths, hue <= 0.5",
        )
        for field in ("flip_prob", "jitter_prob", "grayscale_prob", "blur_prob"):
            need(0 <= getattr(self, field) <= 1, field, "use a probability in [0, 1]")
        need(0 < self.blur_sigma[0] <= self.blur_sigma[1], "blur_sigma", "use 0 < low <= high")
        need(self.eval_resize >= 1, "eval_resize", "use >= 1 (resize, then centre-crop image_size)")

    def view_specs(self) -> list[tuple[int, tuple[float, float]]]:
        """``(size, area_scale)`` of every view, global ones first."""
        return [(self.image_size, self.crop_scale)] * self.num_views + [
            (self.small_size, self.small_scale)
        ] * self.small_crops
