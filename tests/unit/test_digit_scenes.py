"""Digit scenes (``--source digit-scenes``): reproducible, split by source digit, and the digit is
really drawn where the scene says, in a colour that stands out from the background under it."""

import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from data_pipeline.ingest.sources.generated import digits_on_photos, sklearn_digits
from data_pipeline.ingest.sources.scenes import photos, render_scene


def digit_index(origin: str) -> int:
    return int(origin.split("[")[1].split(",")[0])


def decode(image) -> np.ndarray:
    with Image.open(io.BytesIO(image.read())) as decoded:
        assert decoded.size == (32, 32) and decoded.mode == "RGB"
        return np.asarray(decoded)


def test_embedded_photos_are_found():
    assert len(photos()) >= 3  # china, flower (scikit-learn) and grace_hopper (matplotlib)
    assert all(p.ndim == 3 and p.shape[2] == 3 and min(p.shape[:2]) >= 400 for p in photos())


def test_same_seed_same_bytes_other_seed_other_scene():
    first, again, other = (digits_on_photos(split="val", renders_per_digit=2, seed=seed) for seed in (0, 0, 1))
    assert [i.origin for i in first.images] == [i.origin for i in again.images]
    for a, b, c in zip(first.images[:20], again.images[:20], other.images[:20]):
        assert a.read() == b.read()
        assert not np.array_equal(decode(a), decode(c))
    # Renders of one digit differ from each other.
    assert not np.array_equal(decode(first.images[0]), decode(first.images[1]))


def test_split_is_by_source_digit_and_matches_plain_digits():
    train, val = (digits_on_photos(split=split, renders_per_digit=3) for split in ("train", "val"))
    train_digits = {digit_index(i.origin) for i in train.images}
    val_digits = {digit_index(i.origin) for i in val.images}
    assert not train_digits & val_digits
    assert train_digits | val_digits == set(range(1797))
    assert len(val_digits) == round(0.2 * 1797)
    assert len(train.images) == 3 * len(train_digits) and len(val.images) == 3 * len(val_digits)
    # The same held-out digits as the plain set (the origins of sklearn_digits name the index).
    plain_val = {int(i.origin.split("[")[1].rstrip("]")) for i in sklearn_digits(split="val").images}
    assert val_digits == plain_val
    for part in (train, val):
        counts = Counter(i.label for i in part.images)
        assert sorted(counts) == list(range(10))
        assert all(0.05 < n / len(part.images) < 0.15 for n in counts.values())
    labels = load_digits().target
    assert all(i.label == labels[digit_index(i.origin)] for i in train.images[::50])


@pytest.mark.parametrize("background_kind", ["photo", "gradient", "flat"])
@pytest.mark.parametrize("index, render", [(0, 0), (7, 1), (123, 2), (1000, 0), (1796, 4)])
def test_digit_is_drawn_inside_its_box_and_stands_out(index, render, background_kind):
    digit = load_digits().images[index]
    scene, (top, left, height, width) = render_scene(digit, 0, index, render, 32, background=background_kind)
    background, box = render_scene(digit, 0, index, render, 32, background=background_kind, with_digit=False)
    assert box == (top, left, height, width) and scene.shape == background.shape == (32, 32, 3)
    assert 0 <= top and 0 <= left and top + height <= 32 and left + width <= 32

    difference = np.abs(scene.astype(int) - background.astype(int)).max(axis=2)
    inside = np.zeros((32, 32), dtype=bool)
    inside[top : top + height, left : left + width] = True
    assert difference[~inside].max() == 0
    # Strokes: an 8x8 digit has ~30% ink; drawn 14-22 px wide it covers dozens of pixels, each
    # changed clearly (the colour is chosen away from the background's luminance).
    changed = difference > 40
    assert changed.sum() >= 40
    luminance = np.array([0.299, 0.587, 0.114])
    contrast = np.abs(scene @ luminance - background @ luminance)[changed]
    assert np.median(contrast) > 40

    # The ink has the digit's shape: it matches this digit, at some small angle, better than a
    # digit of another class (checked from pixels alone, without the renderer's parameters).
    ink = difference[top : top + height, left : left + width].astype(float)
    digits = load_digits()
    other = digits.images[np.flatnonzero(digits.target != digits.target[index])[index % 100]]
    assert best_match(ink, digit) > 0.6
    assert best_match(ink, digit) > best_match(ink, other)


def match_by_angle(ink: np.ndarray, digit: np.ndarray) -> dict[int, float]:
    """Correlation of ``ink`` with ``digit`` upscaled and turned by each of -30..30 degrees."""
    glyph = Image.fromarray((digit * 15).astype(np.uint8)).resize((32, 32), Image.BICUBIC)
    height, width = ink.shape
    return {
        angle: np.corrcoef(ink.ravel(), np.asarray(glyph.rotate(angle, Image.BICUBIC, expand=True).resize(
            (width, height)), dtype=float).ravel())[0, 1]
        for angle in range(-30, 31, 5)
    }


def best_match(ink: np.ndarray, digit: np.ndarray) -> float:
    return max(match_by_angle(ink, digit).values())


def test_flat_background_is_one_colour_and_max_angle_zero_keeps_digits_upright():
    digits = load_digits().images
    for index in (3, 40, 500):
        scene, (top, left, height, width) = render_scene(digits[index], 0, index, 0, 32, background="flat",
                                                         max_angle=0)
        background = render_scene(digits[index], 0, index, 0, 32, background="flat", max_angle=0, with_digit=False)[0]
        assert len(np.unique(background.reshape(-1, 3), axis=0)) == 1
        ink = np.abs(scene.astype(int) - background.astype(int)).max(axis=2)[top : top + height, left : left + width]
        by_angle = match_by_angle(ink.astype(float), digits[index])
        assert max(by_angle, key=by_angle.get) == 0, by_angle


def test_digit_size_sets_the_glyph_side():
    digit = load_digits().images[0]
    for low, high in ((0.3, 0.3), (0.8, 0.8)):
        _, (_, _, height, width) = render_scene(digit, 0, 0, 0, 40, background="flat", max_angle=0,
                                                digit_fraction=(low, high))
        assert height == width == round(low * 40)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="split"):
        digits_on_photos(split="test")
    with pytest.raises(ValueError, match="renders-per-digit"):
        digits_on_photos(renders_per_digit=0)
    with pytest.raises(ValueError, match="background 'plain'"):
        digits_on_photos(background="plain")
    with pytest.raises(ValueError, match="max-angle"):
        digits_on_photos(max_angle=200)
    with pytest.raises(ValueError, match="digit-size MIN <= MAX"):
        digits_on_photos(digit_fraction=(0.8, 0.6))


def test_gradient_background_blends_two_colours_along_one_direction():
    digits = load_digits().images
    for index in range(10):
        background = render_scene(digits[index], 0, index, 0, 32, background="gradient", with_digit=False)[0]
        colours = background.reshape(-1, 3).astype(float)
        # Every pixel lies on one line in RGB: off the line only by rounding to whole values (RMS
        # below half a level), along it by a real blend, not one flat colour.
        spread = np.linalg.svd(colours - colours.mean(0), compute_uv=False) / np.sqrt(len(colours))
        assert spread[1] < 0.5 and spread[0] > 5


@pytest.mark.parametrize("background_kind", ["photo", "gradient", "flat"])
def test_shared_backgrounds_come_from_a_small_pool(background_kind):
    digits = load_digits().images
    pooled = {render_scene(digits[i], 0, i, 0, 32, backgrounds=4, background=background_kind,
                           with_digit=False)[0].tobytes() for i in range(40)}
    assert len(pooled) == 4
    fresh = {render_scene(digits[i], 0, i, 0, 32, background=background_kind, with_digit=False)[0].tobytes()
             for i in range(40)}
    assert len(fresh) == 40
