"""The augmentation settings of a job: a recipe by name (``data_pipeline.loading.augment.recipes``),
any of its parameters overridden, and the view sizes.  Shared by the DALI and fallback loaders.

Per view: random resized crop (aspect 3/4-4/3) -> horizontal flip -> colour jitter -> grayscale ->
Gaussian blur -> solarize -> normalise with the ImageNet mean/std, CHW float32.  The recipe gives
every strength and probability (MoCo v2's "aug+" unless a job's objective or config names another);
a field set here replaces the recipe's value on every view.  Multi-crop adds ``small_crops`` views of
``small_size`` pixels cut from ``small_scale`` of the area.

Both loaders apply it from parameters drawn in Python (``data_pipeline.loading.augment.view_params``); colour
jitter and grayscale form one affine colour map (``data_pipeline.loading.augment.colour`` gives its exact
semantics), and the blur kernel of a sigma spans ``2*ceil(3*sigma)+1`` pixels (DALI's default).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from data_pipeline.loading.augment.recipes import DEFAULT_RECIPE, RECIPES, Recipe, recipe_names

CROP_ASPECT = (3 / 4, 4 / 3)  # aspect-ratio range of every random resized crop
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class AugmentConfig:
    """Attributes:
    recipe: the augmentation recipe by name, a key of ``RECIPES`` in ``data_pipeline/loading/augment/recipes.py``
        ("moco_v2", "simclr", "byol", ...).  Unset: the objective's paper's recipe in a job (``moco_v2`` for the
        shipped objectives), ``moco_v2`` for a loader built outside one.
    image_size: side of the global views (224 for ImageNet, 32 for the CPU demo).
    num_views: global views per image (2 in the paper).
    small_crops: extra small views per image (multi-crop; 0 disables it).
    small_size: side of the small views.
    small_scale: area range of the small crops.
    eval_resize: inference pipeline resizes the shorter side to image_size * eval_resize, then
        centre-crops image_size (256/224 for ImageNet).

    The recipe's parameters, each unset by default (the recipe's value) or set to replace it on every
    view:
    crop_scale: area range of the random resized crop of global views.
    flip_prob: probability of a horizontal flip (0 for data where mirroring changes meaning, such
        as digits).
    jitter: colour-jitter strengths (brightness, contrast, saturation, hue): factors drawn from
        ``[max(0, 1 - s), 1 + s]`` and a hue turn from ``[-h, h]``, applied as one affine map in a
        fixed order, contrast about mid-grey and hue turned in YIQ (``colour`` defines it).
    jitter_prob / grayscale_prob / blur_prob / solarize_prob: probabilities of those steps.
    blur_sigma: range of the Gaussian blur's sigma, in pixels.
    """

    recipe: str | None = None
    image_size: int = 224
    num_views: int = 2
    crop_scale: tuple[float, float] | None = None
    small_crops: int = 0
    small_size: int = 96
    small_scale: tuple[float, float] = (0.05, 0.2)
    flip_prob: float | None = None
    jitter: tuple[float, float, float, float] | None = None
    jitter_prob: float | None = None
    grayscale_prob: float | None = None
    blur_prob: float | None = None
    solarize_prob: float | None = None
    blur_sigma: tuple[float, float] | None = None
    eval_resize: float = 256 / 224

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r} is invalid: {fix}")

        def unset_or(field: str, ok) -> bool:
            return getattr(self, field) is None or ok(getattr(self, field))

        need(self.recipe is None or self.recipe in RECIPES, "recipe",
             f"choose one of {', '.join(recipe_names())} (data_pipeline/loading/augment/recipes.py), or leave it "
             "unset for the objective's")
        need(self.image_size >= 8, "image_size", "use at least 8 pixels")
        need(self.num_views >= 1, "num_views", "use at least 1 view (the paper uses 2)")
        need(self.small_crops >= 0, "small_crops", "use 0 to disable multi-crop, or a positive count")
        need(self.small_size >= 8, "small_size", "use at least 8 pixels")
        for field in ("crop_scale", "small_scale"):
            need(unset_or(field, lambda scale: 0 < scale[0] <= scale[1] <= 1), field,
                 "use 0 < low <= high <= 1 (fractions of the image area)")
        need(unset_or("jitter", lambda strengths: all(v >= 0 for v in strengths) and strengths[3] <= 0.5), "jitter",
             "use non-negative strengths, hue <= 0.5")
        for field in ("flip_prob", "jitter_prob", "grayscale_prob", "blur_prob", "solarize_prob"):
            need(unset_or(field, lambda p: 0 <= p <= 1), field, "use a probability in [0, 1]")
        need(unset_or("blur_sigma", lambda sigma: 0 < sigma[0] <= sigma[1]), "blur_sigma", "use 0 < low <= high")
        need(self.eval_resize >= 1, "eval_resize", "use >= 1 (resize, then centre-crop image_size)")

    def effective_recipe(self) -> Recipe:
        """The named recipe (the default when unset) with the fields set here in place of its values."""
        named = RECIPES[self.recipe or DEFAULT_RECIPE]
        probabilities = {"jitter": self.jitter_prob, "grayscale": self.grayscale_prob, "blur": self.blur_prob,
                         "solarize": self.solarize_prob}
        overridden = {name: value for name, value in probabilities.items() if value is not None}
        shared = {name: getattr(self, name) for name in ("crop_scale", "flip_prob", "jitter", "blur_sigma")
                  if getattr(self, name) is not None}
        return replace(named, views=tuple(replace(view, **overridden) for view in named.views), **shared)

    def view_specs(self) -> list[tuple[int, tuple[float, float]]]:
        """``(size, area_scale)`` of every view, global ones first."""
        return [(self.image_size, self.effective_recipe().crop_scale)] * self.num_views + [
            (self.small_size, self.small_scale)
        ] * self.small_crops
