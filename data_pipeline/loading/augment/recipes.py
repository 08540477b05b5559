"""The augmentation recipes, by name: ``data.loader.augment.recipe`` picks one, and each objective names
its paper's as the default (``ObjectiveConfig.default_recipe``).  A new recipe is one entry in ``RECIPES``.

Every entry holds all of its parameters and the paper they come from.  Both loaders apply them the same
way, per view: random resized crop (aspect 3/4-4/3) -> horizontal flip -> colour jitter -> grayscale
(one affine colour map, ``data_pipeline.loading.augment.colour``) -> Gaussian blur -> solarize.  The
probabilities are per view, so a recipe may treat its views differently (BYOL's): view ``k`` of a step
(global views first, then multi-crop's small ones) takes ``views[k % len(views)]``.

What is the papers' and what is ours: the numbers below are the papers'; the jitter's semantics are
ours (``colour``: a fixed order, contrast about mid-grey, hue turned in YIQ, where the papers' code
applies the four in a random order, contrast about the image mean and hue in HSV), and so is the blur
kernel's side, ``2*ceil(3*sigma)+1`` (SimCLR and BYOL use a tenth of the image side).  Solarize maps
a level ``x`` of 0..255 to ``x`` below 128 and ``255 - x`` from 128 on (BYOL's ``x < 0.5`` on 0..1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ViewProbabilities:
    """How likely each optional step is on one view: colour ``jitter``, ``grayscale``, ``blur``, ``solarize``."""

    jitter: float
    grayscale: float
    blur: float
    solarize: float = 0.0

    def __post_init__(self) -> None:
        for name in ("jitter", "grayscale", "blur", "solarize"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is not a probability: use one in [0, 1]")


@dataclass(frozen=True)
class Recipe:
    """Attributes:
    source: the paper (and where in it) the numbers come from.
    crop_scale: area range of the random resized crop of the global views (fractions of the image).
    flip_prob: probability of a horizontal flip.
    jitter: colour-jitter strengths (brightness, contrast, saturation, hue): factors drawn uniformly from
        ``[max(0, 1 - s), 1 + s]``, the hue turn from ``[-h, h]`` of a full turn.
    blur_sigma: range of the Gaussian blur's sigma, in pixels.
    views: the probabilities of the optional steps, per view (one entry: every view alike).
    """

    source: str
    crop_scale: tuple[float, float]
    jitter: tuple[float, float, float, float]
    views: tuple[ViewProbabilities, ...]
    flip_prob: float = 0.5
    blur_sigma: tuple[float, float] = (0.1, 2.0)

    def __post_init__(self) -> None:
        if not self.views:
            raise ValueError("a recipe needs the probabilities of at least one view")

    def view(self, index: int) -> ViewProbabilities:
        """The probabilities of view ``index`` (global views first, then the small ones)."""
        return self.views[index % len(self.views)]


RECIPES: dict[str, Recipe] = {
    # The default, and what every shipped config trained with.
    "moco_v2": Recipe(
        source="MoCo v2: Chen, Fan, Girshick, He, Improved Baselines with Momentum Contrastive Learning, "
               "arXiv 2003.04297, Section 3 ('aug+') and its code (main_moco.py --aug-plus)",
        crop_scale=(0.2, 1.0),
        jitter=(0.4, 0.4, 0.4, 0.1),
        views=(ViewProbabilities(jitter=0.8, grayscale=0.2, blur=0.5),),
    ),
    # Colour distortion of strength 1: jitter (0.8 s, 0.8 s, 0.8 s, 0.2 s).
    "simclr": Recipe(
        source="SimCLR: Chen, Kornblith, Norouzi, Hinton, A Simple Framework for Contrastive Learning of Visual "
               "Representations, ICML 2020, arXiv 2002.05709, Appendix A",
        crop_scale=(0.08, 1.0),
        jitter=(0.8, 0.8, 0.8, 0.2),
        views=(ViewProbabilities(jitter=0.8, grayscale=0.2, blur=0.5),),
    ),
    # Asymmetric: the first view always blurred and never solarized, the second rarely blurred and
    # sometimes solarized.
    "byol": Recipe(
        source="BYOL: Grill et al., Bootstrap Your Own Latent: A New Approach to Self-Supervised Learning, "
               "NeurIPS 2020, arXiv 2006.07733, Appendix B, Table 6",
        crop_scale=(0.08, 1.0),
        jitter=(0.4, 0.4, 0.2, 0.1),
        views=(ViewProbabilities(jitter=0.8, grayscale=0.2, blur=1.0, solarize=0.0),
               ViewProbabilities(jitter=0.8, grayscale=0.2, blur=0.1, solarize=0.2)),
    ),
}

DEFAULT_RECIPE = "moco_v2"  # a loader built outside a job, and the shipped objectives' default
SOLARIZE_THRESHOLD = 128  # levels of 0..255 from here on are inverted (BYOL: 0.5 of 0..1)


def recipe_names() -> tuple[str, ...]:
    return tuple(RECIPES)
