"""Digit scenes: one scikit-learn digit drawn at a random place, size, angle and colour over a
background that carries most of the pixel variance and none of the label.

The plain digits are too easy to show learning (a random network already scores ~93% kNN).  Two
background kinds: ``photo``, a random crop of a photograph that ships inside an installed package
(busy texture; a random network scores ~32%), and ``gradient``, a linear blend between two random
colours at a random angle (a random network scores ~27%, yet SimCLR-style colour augmentation can
teach invariance to it, so training has something clear to learn).  Everything is embedded:
nothing is downloaded, and a scene is a pure function of (digit pixels, seed, digit index, render
index, size, style).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

CROP_FRACTION = (0.08, 0.5)  # of the photo's shorter side: from smooth close-ups to busy wide views
DIGIT_FRACTION = (0.45, 0.7)  # of the image side, before rotation
MAX_ANGLE = 30.0  # degrees; wider turns confuse 6 and 9
MARGIN_FRACTION = 0.08  # keeps the digit inside the evaluation's centre crop (resize 256/224, crop)
STROKE_GAIN = 1.5  # the upscaled strokes are soft; a gain > 1 makes their cores opaque


@lru_cache(maxsize=1)
def photos() -> tuple[np.ndarray, ...]:
    """The RGB photos of scikit-learn (china, flower) and matplotlib's sample data (JPEGs only:
    its PNGs are logos).  Cached per process, since shard workers render many scenes each."""
    import matplotlib
    from sklearn.datasets import load_sample_images

    found = list(load_sample_images().images)
    for path in sorted((Path(matplotlib.get_data_path()) / "sample_data").glob("*.jpg")):
        with Image.open(path) as photo:
            found.append(np.asarray(photo.convert("RGB")))
    return tuple(found)


def _luminance(rgb: np.ndarray) -> np.ndarray:
    return rgb @ np.array([0.299, 0.587, 0.114], dtype=np.float32)


def _crop(rng: np.random.Generator, size: int) -> np.ndarray:
    library = photos()
    photo = library[rng.integers(len(library))]
    height, width = photo.shape[:2]
    side = int(rng.uniform(*CROP_FRACTION) * min(height, width))
    top, left = rng.integers(0, height - side + 1), rng.integers(0, width - side + 1)
    crop = Image.fromarray(photo[top : top + side, left : left + side]).resize((size, size), Image.BILINEAR)
    if rng.random() < 0.5:
        crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(crop, dtype=np.float32)


def _gradient(rng: np.random.Generator, size: int) -> np.ndarray:
    """Two random colours blended along a random direction across the image."""
    start, end = rng.uniform(0.0, 255.0, size=(2, 3)).astype(np.float32)
    angle = rng.uniform(0.0, 2.0 * np.pi)
    rows, cols = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
    along = np.cos(angle) * cols + np.sin(angle) * rows
    along = (along - along.min()) / max(float(along.max() - along.min()), 1e-6)
    return start + along[..., None] * (end - start)


def _flat(rng: np.random.Generator, size: int) -> np.ndarray:
    """One random colour: the only nuisance is colour, which SimCLR-style colour jitter and
    grayscale teach a network to ignore within a few minutes of CPU training (the demo's kind)."""
    return np.broadcast_to(rng.uniform(0.0, 255.0, size=3).astype(np.float32), (size, size, 3)).copy()


BACKGROUND_KINDS = {"photo": _crop, "gradient": _gradient, "flat": _flat}


def _background(kind: str, rng: np.random.Generator, size: int) -> np.ndarray:
    if kind not in BACKGROUND_KINDS:
        raise ValueError(f"digit-scenes background {kind!r}: choose one of {sorted(BACKGROUND_KINDS)}")
    return BACKGROUND_KINDS[kind](rng, size)


def shared_background(seed: int, index: int, size: int, kind: str = "photo") -> np.ndarray:
    """Background ``index`` of a pool that many scenes share (its own stream, apart from scenes')."""
    return _background(kind, np.random.default_rng([seed, 1 << 40, index]), size)


def _place(rng: np.random.Generator, extent: int, size: int, margin: int) -> int:
    # A glyph too big for the margins (large and turned, at a small image size) is centred.
    if extent + 2 * margin > size:
        return (size - extent) // 2
    return int(rng.integers(margin, size - margin - extent + 1))


def render_scene(digit: np.ndarray, seed: int, digit_index: int, render_index: int, image_size: int,
                 backgrounds: int = 0, colour_mix: float = 0.3, background: str = "photo",
                 with_digit: bool = True, max_angle: float = MAX_ANGLE,
                 digit_fraction: tuple[float, float] = DIGIT_FRACTION) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """``(uint8 [S, S, 3] image, (top, left, height, width) of the digit's box)``.

    ``digit`` is an 8x8 array with values 0..16 (``load_digits().images[i]``).  ``backgrounds``: 0
    crops a fresh background per scene, N > 0 picks one of N shared crops (then a background alone
    cannot tell instances apart).  ``background``: ``photo`` or ``gradient`` (module docstring).
    ``colour_mix``: how much of a random colour survives in the
    dark or bright digit (0: black or white digits).  ``with_digit=False`` returns the same
    scene's background alone, for checking where the digit went.  ``max_angle``: the digit turns by
    up to this many degrees either way; ``digit_fraction``: the range of its side, as a fraction of
    the image's, before turning.
    """
    size = image_size
    rng = np.random.default_rng([seed, digit_index, render_index])
    if backgrounds:
        scene = shared_background(seed, int(rng.integers(backgrounds)), size, background)
    else:
        scene = _background(background, rng, size)

    glyph_side = max(4, round(rng.uniform(*digit_fraction) * size))
    glyph = Image.fromarray((digit * (255.0 / 16.0)).astype(np.uint8)).resize((glyph_side, glyph_side), Image.BICUBIC)
    glyph = glyph.rotate(rng.uniform(-max_angle, max_angle), Image.BICUBIC, expand=True)
    alpha = np.clip(np.asarray(glyph, dtype=np.float32) / 255.0 * STROKE_GAIN, 0.0, 1.0)[:size, :size]
    box_h, box_w = alpha.shape
    margin = round(MARGIN_FRACTION * size)
    row, col = _place(rng, box_h, size, margin), _place(rng, box_w, size, margin)
    base = rng.uniform(0.0, 255.0, size=3).astype(np.float32)
    box = (row, col, box_h, box_w)
    if not with_digit:
        return _to_uint8(scene), box

    # Legibility: a dark or a bright version of the random colour, whichever is further in
    # luminance from the background under the strokes.
    region = scene[row : row + box_h, col : col + box_w]
    under = _luminance((alpha[..., None] * region).sum((0, 1)) / max(float(alpha.sum()), 1e-6))
    dark, bright = base * colour_mix, 255.0 - (255.0 - base) * colour_mix
    colour = dark if abs(_luminance(dark) - under) >= abs(_luminance(bright) - under) else bright
    region[...] = region * (1.0 - alpha[..., None]) + colour * alpha[..., None]
    return _to_uint8(scene), box


def _to_uint8(scene: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(scene), 0, 255).astype(np.uint8)
