"""Where images come from before they become shards: the digits set that ships inside
scikit-learn (plain, or drawn onto embedded photos), or synthetic images; a user's own files are
``data_pipeline.ingest.sources.files``, existing WebDataset tars ``data_pipeline.ingest.tars_in_place``.

Each source lists ``SourceImage`` records in a fixed order; the shard writer shuffles them with a
seed and assigns the dense instance ids.  ``read`` runs in worker processes, so a record carries a
picklable recipe for its bytes (a path, a small array, a seed), never an open file or a big image.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np
from PIL import Image

from data_pipeline.ingest.sources.registry import Flag, SourceKind
from data_pipeline.ingest.sources.scenes import BACKGROUND_KINDS, DIGIT_FRACTION, MAX_ANGLE

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}
NO_LABEL = -1


@dataclass(frozen=True)
class SourceImage:
    """One image to shard: its origin (for error messages), its semantic label or ``NO_LABEL``,
    and ``read()``, which returns its encoded bytes."""

    origin: str
    label: int
    read: Callable[[], bytes]


def _png_bytes(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")  # lossless hand-off to the JPEG encoder
    return buffer.getvalue()


def _synthetic_png(seed: int, index: int, image_size: int) -> bytes:
    # Upscaled low-resolution noise: JPEG sizes and decode cost closer to photos than white noise.
    rng = np.random.default_rng([seed, index])
    coarse = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    return _png_bytes(np.asarray(Image.fromarray(coarse).resize((image_size, image_size), Image.BILINEAR)))


@dataclass(frozen=True)
class Source:
    """A list of images and, when labelled, the names of their classes."""

    name: str
    images: Sequence[SourceImage]  # or a listing streamed on demand (``files.FileListing``)
    class_names: list[str] | None

    def listing_sha256(self) -> str:
        """A digest of what is listed (origins and labels, in order): the same inputs give the
        same digest, so the parts of an ingest can check they shard the same listing."""
        own = getattr(self.images, "sha256", None)
        if own is not None:
            return own()
        digest = hashlib.sha256()
        for image in self.images:
            digest.update(f"{image.origin}\t{image.label}\n".encode("utf-8", "surrogateescape"))
        return digest.hexdigest()


DIGITS_SPLITS = ("all", "train", "val")


def _digits_split(count: int, split: str, val_fraction: float) -> Callable[[int], bool]:
    """Whether digit ``index`` belongs to ``split``: a fixed seeded ``val_fraction`` is held out."""
    if split not in DIGITS_SPLITS:
        raise ValueError(f"--split {split!r}: choose one of {DIGITS_SPLITS}")
    held_out = set(np.random.default_rng(0).permutation(count)[: round(val_fraction * count)].tolist())
    return {"all": lambda i: True, "train": lambda i: i not in held_out, "val": lambda i: i in held_out}[split]


def sklearn_digits(image_size: int = 32, split: str = "all", val_fraction: float = 0.2) -> Source:
    """The 1797 labelled 8x8 digits of ``sklearn.datasets.load_digits`` (shipped with the package,
    nothing is downloaded), upscaled to ``image_size`` and stored as RGB.

    ``split`` picks a fixed held-out part (``val``, a seeded ``val_fraction`` of the images) or the
    rest (``train``), so unsupervised training never sees the images kNN evaluation is scored on.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    keep = _digits_split(len(digits.images), split, val_fraction)
    images = []
    for index, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        if not keep(index):
            continue
        gray = Image.fromarray((pixels * (255.0 / 16.0)).astype(np.uint8))
        rgb = np.asarray(gray.resize((image_size, image_size), Image.BICUBIC).convert("RGB"))
        images.append(SourceImage(origin=f"sklearn-digits[{index}]", label=int(label), read=partial(_png_bytes, rgb)))
    return Source(name=f"sklearn-digits:{split}", images=images, class_names=[str(d) for d in range(10)])


def _scene_png(digit: np.ndarray, seed: int, digit_index: int, render_index: int, image_size: int,
               backgrounds: int, colour_mix: float, background: str, max_angle: float,
               digit_fraction: tuple[float, float]) -> bytes:
    from data_pipeline.ingest.sources.scenes import render_scene

    scene, _ = render_scene(digit, seed, digit_index, render_index, image_size, backgrounds, colour_mix, background,
                            max_angle=max_angle, digit_fraction=digit_fraction)
    return _png_bytes(scene)


def digits_on_photos(image_size: int = 32, split: str = "all", renders_per_digit: int = 3, seed: int = 0,
                     backgrounds: int = 0, colour_mix: float = 0.3, val_fraction: float = 0.2,
                     background: str = "photo", max_angle: float = MAX_ANGLE,
                     digit_fraction: tuple[float, float] = DIGIT_FRACTION) -> Source:
    """The scikit-learn digits drawn onto crops of embedded photographs or onto colour gradients
    (``data_pipeline.ingest.sources.scenes``, which explains ``background``, ``backgrounds`` and ``colour_mix``),
    ``renders_per_digit`` scenes per digit: a harder labelled set than ``sklearn_digits``.

    The split is by source digit with the same rule as ``sklearn_digits``, so no held-out digit
    appears in training under another background.  Records hold only the recipe; ``read`` renders.
    """
    from sklearn.datasets import load_digits

    if background not in BACKGROUND_KINDS:
        raise ValueError(f"--background {background!r}: choose one of {sorted(BACKGROUND_KINDS)}")
    if renders_per_digit < 1 or image_size < 16 or backgrounds < 0 or not 0 <= colour_mix <= 1 \
            or not 0 <= max_angle <= 180 or not 0.1 <= digit_fraction[0] <= digit_fraction[1] <= 1:
        raise ValueError("digit scenes need --renders-per-digit >= 1, --image-size >= 16, --backgrounds >= 0, "
                         "0 <= --colour-mix <= 1, 0 <= --max-angle <= 180 and 0.1 <= --digit-size MIN <= MAX <= 1")
    digits = load_digits()
    keep = _digits_split(len(digits.images), split, val_fraction)
    images = [
        SourceImage(origin=f"digit-scene[{index}, {render}]", label=int(label),
                    read=partial(_scene_png, pixels, seed, index, render, image_size, backgrounds, colour_mix,
                                 background, max_angle, tuple(digit_fraction)))
        for index, (pixels, label) in enumerate(zip(digits.images, digits.target)) if keep(index)
        for render in range(renders_per_digit)
    ]
    name = (f"digit-scenes:{split}:background={background}:renders={renders_per_digit}:"
            f"backgrounds={backgrounds}:colour_mix={colour_mix}:max_angle={max_angle}:"
            f"digit_size={digit_fraction[0]}-{digit_fraction[1]}:seed={seed}")
    return Source(name=name, images=images, class_names=[str(d) for d in range(10)])


class SyntheticImages(Sequence):
    """The records of ``count`` synthetic images, each made when asked for: a list of 14.2M records
    would hold gigabytes, and a part of an ingest reads only its share."""

    _DIGEST_BLOCK = 1 << 16

    def __init__(self, count: int, image_size: int, seed: int) -> None:
        self.count, self.image_size, self.seed = count, image_size, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.count))]
        if not -self.count <= index < self.count:
            raise IndexError(f"synthetic image {index} of {self.count}")
        index %= self.count
        return SourceImage(origin=f"synthetic[{index}]", label=NO_LABEL,
                           read=partial(_synthetic_png, self.seed, index, self.image_size))

    def sha256(self) -> str:
        """``Source.listing_sha256``'s digest of these records, without making them."""
        digest = hashlib.sha256()
        for start in range(0, self.count, self._DIGEST_BLOCK):
            end = min(start + self._DIGEST_BLOCK, self.count)
            digest.update("".join(f"synthetic[{i}]\t{NO_LABEL}\n" for i in range(start, end)).encode())
        return digest.hexdigest()


def synthetic(count: int, image_size: int, seed: int = 0) -> Source:
    """``count`` random smooth colour images (no labels) for benchmarks at real image sizes."""
    if count < 1 or image_size < 8:
        raise ValueError("synthetic images need --count >= 1 and --image-size >= 8")
    return Source(name=f"synthetic:{count}x{image_size}", images=SyntheticImages(count, image_size, seed),
                  class_names=None)


# --- as `instcls make-shards --source digits | digit-scenes | synthetic` -------------------------

def _kinds() -> tuple[SourceKind, SourceKind, SourceKind]:
    size = Flag("--image-size", "side of the images in pixels (default 32)", {"type": int, "default": 32})
    split = Flag("--split", "the fixed 20%% held-out digits (val) or the rest (train)",
                 {"default": "all", "choices": list(DIGITS_SPLITS)})
    digits = SourceKind("digits", "the labelled set inside scikit-learn", (size, split), labels=("none",),
                        open=lambda a: sklearn_digits(a.image_size, split=a.split))
    scene_flags = (
        size, split,
        Flag("--renders-per-digit", "scenes drawn per digit (default 3)", {"type": int, "default": 3}),
        Flag("--backgrounds", "number of shared background crops (default 0: a fresh crop per scene)",
             {"type": int, "default": 0}),
        Flag("--background", "crops of embedded photos, two-colour gradients or one flat colour (default photo; "
             "the demo uses flat)", {"default": "photo", "choices": list(BACKGROUND_KINDS)}),
        Flag("--colour-mix", "how much of a random colour survives in the digit (0: black or white; default 0.3)",
             {"type": float, "default": 0.3}),
        Flag("--max-angle", f"largest turn of a digit in degrees (default {MAX_ANGLE})",
             {"type": float, "default": MAX_ANGLE}),
        Flag("--digit-size", f"range of a digit's side as a fraction of the image's (default {DIGIT_FRACTION})",
             {"type": float, "nargs": 2, "default": DIGIT_FRACTION, "metavar": ("MIN", "MAX")}),
    )
    scenes = SourceKind(
        "digit-scenes", "those digits drawn onto photo crops, gradients or flat colours (harder)", scene_flags,
        open=lambda a: digits_on_photos(a.image_size, split=a.split, renders_per_digit=a.renders_per_digit,
                                        seed=a.seed, backgrounds=a.backgrounds, background=a.background,
                                        colour_mix=a.colour_mix, max_angle=a.max_angle,
                                        digit_fraction=tuple(a.digit_size)))
    count = Flag("--count", "number of images (default 1000)", {"type": int, "default": 1000})
    random_images = SourceKind("synthetic", "random images", (count, size),
                               open=lambda a: synthetic(a.count, a.image_size, a.seed))
    return digits, scenes, random_images


DIGITS, DIGIT_SCENES, SYNTHETIC = _kinds()
