"""Every random number of the augmentation, drawn in Python before any pixel is decoded.

DALI's per-pipeline RNG cannot be fast-forwarded, so a resumed run could not replay step k
without running steps 0..k-1.  Here every parameter of a sample is a counter-based draw keyed by
``(seed, epoch, sample id, draw)`` (``SampleStreams``): a step is reproducible on its own, the DALI
and the fallback loader apply the very same parameters, and an image is augmented the same way
whichever rank reads it, so a job resumed on another number of ranks (an elastic restart) sees the
same views.  The draws per sample are fixed in number and order (every parameter is drawn even when
its step is off), so one parameter never shifts another.

Per view and sample (the recipe: ``data_pipeline.loading.augment.recipes``): random resized crop (torchvision's
rule: up to 10 tries of area and log-uniform aspect, else a centre crop), horizontal flip, colour
jitter and grayscale (one affine colour map, ``data_pipeline.loading.augment.colour``), Gaussian blur,
solarize.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from data_pipeline.loading.augment.augment_config import CROP_ASPECT, AugmentConfig
from data_pipeline.loading.augment.colour import colour_maps

CROP_ATTEMPTS = 10


@dataclass(frozen=True)
class ViewParams:
    """One view of every sample of a step (arrays over the batch).

    ``crop``: int64 ``[b, 4]`` top, left, height, width in source pixels, resized to ``size``
    square; ``flip``: bool ``[b]``; ``colour``: float32 ``[b, 3, 4]`` affine map ``[M | t]`` on
    RGB 0..255; ``blur``: bool ``[b]``; ``sigma``: float32 ``[b]`` and ``window``: int32 ``[b]``,
    the Gaussian kernel's side ``2*ceil(3*sigma)+1`` (used where ``blur``); ``solarize``: bool ``[b]``.
    """

    size: int
    crop: np.ndarray
    flip: np.ndarray
    colour: np.ndarray
    blur: np.ndarray
    sigma: np.ndarray
    window: np.ndarray
    solarize: np.ndarray


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: uint64 -> uint64, a bijection whose outputs look independent."""
    with np.errstate(over="ignore"):
        values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return values ^ (values >> np.uint64(31))


class SampleStreams:
    """Random numbers for a batch of samples, one independent stream per sample: row ``i`` of each
    draw depends only on ``(seed, epoch, ids[i])`` and how many numbers the calls before drew, not
    on the other samples of the batch, its order, the step or the rank.  Implements the two
    ``numpy.random.Generator`` methods the recipe uses, over ``(count, ...)`` shapes."""

    def __init__(self, seed: int, epoch: int, ids: np.ndarray) -> None:
        with np.errstate(over="ignore"):
            key = _mix(np.uint64(seed % 2 ** 64) * _GOLDEN + _mix(np.uint64(epoch % 2 ** 64) + _GOLDEN))
            self._keys = _mix(key ^ (np.asarray(ids, dtype=np.uint64) * _GOLDEN))  # [count]
        self._drawn = 0

    def random(self, shape) -> np.ndarray:
        """Uniform floats in [0, 1), float64, of ``shape`` (an int: ``count``; else ``(count, ...)``)."""
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if shape[0] != self._keys.shape[0]:
            raise ValueError(f"draws of shape {shape} for {self._keys.shape[0]} samples: the first axis is the sample")
        per_sample = int(np.prod(shape[1:], dtype=np.int64))
        counters = np.arange(self._drawn, self._drawn + per_sample, dtype=np.uint64)
        self._drawn += per_sample
        with np.errstate(over="ignore"):
            bits = _mix(self._keys[:, None] + (counters[None, :] + np.uint64(1)) * _GOLDEN)
        return ((bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53).reshape(shape)

    def uniform(self, low, high, shape) -> np.ndarray:
        low, high = np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)
        return low + (high - low) * self.random(shape)


def augmentation_rng(seed: int, epoch: int, ids: np.ndarray) -> SampleStreams:
    """The draws of one step's samples (``ids``, in the order the step reads them)."""
    return SampleStreams(seed, epoch, ids)


def image_size(data: bytes) -> tuple[int, int]:
    """``(height, width)`` from the image header (PIL reads no pixels for this)."""
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    return height, width


def crop_boxes(rng: np.random.Generator | SampleStreams, heights: np.ndarray, widths: np.ndarray,
               scale: tuple[float, float], ratio: tuple[float, float] = CROP_ASPECT) -> np.ndarray:
    """Random resized crop boxes ``[b, 4]`` (top, left, height, width), torchvision's rule."""
    count = heights.shape[0]
    heights, widths = heights.astype(np.float64), widths.astype(np.float64)
    target_area = (heights * widths)[:, None] * rng.uniform(scale[0], scale[1], (count, CROP_ATTEMPTS))
    aspect = np.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1]), (count, CROP_ATTEMPTS)))
    position = rng.random((count, 2))
    crop_w, crop_h = np.round(np.sqrt(target_area * aspect)), np.round(np.sqrt(target_area / aspect))
    fits = (crop_w > 0) & (crop_w <= widths[:, None]) & (crop_h > 0) & (crop_h <= heights[:, None])
    first = fits.argmax(axis=1)
    crop_w, crop_h = crop_w[np.arange(count), first], crop_h[np.arange(count), first]
    top = np.floor(position[:, 0] * (heights - crop_h + 1))
    left = np.floor(position[:, 1] * (widths - crop_w + 1))
    # No try fits: the whole image, cut to the nearest allowed aspect ratio, centred.
    in_ratio = widths / heights
    centre_w = np.where(in_ratio > ratio[1], np.round(heights * ratio[1]), widths)
    centre_h = np.where(in_ratio < ratio[0], np.round(widths / ratio[0]), heights)
    missed = ~fits.any(axis=1)
    crop_w, crop_h = np.where(missed, centre_w, crop_w), np.where(missed, centre_h, crop_h)
    top = np.where(missed, (heights - crop_h) // 2, top)
    left = np.where(missed, (widths - crop_w) // 2, left)
    return np.stack([top, left, crop_h, crop_w], axis=1).astype(np.int64)


def draw_views(rng: np.random.Generator | SampleStreams, heights: np.ndarray, widths: np.ndarray,
               augment: AugmentConfig) -> list[ViewParams]:
    """The parameters of every view of ``augment.view_specs()`` (global views first), with view ``k``'s
    probabilities from ``augment.effective_recipe().view(k)``.

    The solarize flags are drawn after every other parameter of every view, so that a recipe without
    solarization draws, for the same sample, exactly the numbers it drew before solarize existed."""
    count = heights.shape[0]
    recipe = augment.effective_recipe()
    brightness, contrast, saturation, hue = recipe.jitter
    low = np.array([max(0.0, 1 - brightness), max(0.0, 1 - contrast), max(0.0, 1 - saturation), -hue])
    high = np.array([1 + brightness, 1 + contrast, 1 + saturation, hue])
    drawn = []
    for k, (size, area) in enumerate(augment.view_specs()):
        chance = recipe.view(k)
        crop = crop_boxes(rng, heights, widths, area)
        flip = rng.random(count) < recipe.flip_prob
        jitter = rng.random(count) < chance.jitter
        factors = rng.uniform(low, high, (count, 4))
        grayscale = rng.random(count) < chance.grayscale
        blur = rng.random(count) < chance.blur
        sigma = rng.uniform(recipe.blur_sigma[0], recipe.blur_sigma[1], count).astype(np.float32)
        window = (2 * np.ceil(3 * sigma) + 1).astype(np.int32)
        drawn.append((size, crop, flip, colour_maps(factors, jitter, grayscale), blur, sigma, window))
    solarize = [rng.random(count) < recipe.view(k).solarize for k in range(len(drawn))]
    return [ViewParams(*params, solarize=flags) for params, flags in zip(drawn, solarize)]
