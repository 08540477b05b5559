"""Augmentation parameters: torchvision's crop rule, reproducible per (seed, epoch, step, rank),
and colour maps that do what ``data_pipeline.loading.augment.colour`` says."""

import numpy as np

from data_pipeline.loading.augment.augment_config import AugmentConfig
from data_pipeline.loading.augment.colour import LUMA, colour_maps
from data_pipeline.loading.augment.view_params import augmentation_rng, crop_boxes, draw_views


def test_crop_boxes_lie_inside_the_image_with_the_asked_area_and_aspect():
    rng = np.random.default_rng(0)
    heights = rng.integers(100, 400, 500)
    widths = np.round(heights * rng.uniform(0.6, 1.6, 500)).astype(np.int64)  # moderate aspects: a crop try fits
    top, left, height, width = crop_boxes(rng, heights, widths, (0.2, 1.0)).T
    assert (top >= 0).all() and (left >= 0).all() and (height >= 1).all() and (width >= 1).all()
    assert (top + height <= heights).all() and (left + width <= widths).all()
    area = height * width / (heights * widths)
    assert 0.15 < area.min() and area.max() <= 1.0
    aspect = width / height
    assert 0.7 < aspect.min() and aspect.max() < 1.4


def test_a_crop_that_never_fits_is_the_centre_at_the_nearest_aspect():
    box = crop_boxes(np.random.default_rng(0), np.array([10]), np.array([1000]), (0.9, 1.0))
    assert box.tolist() == [[0, 493, 10, 13]]  # height kept, width = round(10 * 4/3), centred


def test_parameters_depend_only_on_seed_epoch_step_and_rank():
    augment = AugmentConfig(image_size=32, small_crops=2, small_size=16)
    heights, widths = np.full(8, 40), np.full(8, 50)
    draw = lambda *key: draw_views(augmentation_rng(*key), heights, widths, augment)  # noqa: E731
    first, again, other_step = draw(0, 1, 2, 3), draw(0, 1, 2, 3), draw(0, 1, 3, 3)
    assert [v.size for v in first] == [32, 32, 16, 16]
    for a, b, c in zip(first, again, other_step):
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("crop", "flip", "colour", "blur", "sigma"))
        assert not np.array_equal(a.crop, c.crop)
    assert (first[0].window == 2 * np.ceil(3 * first[0].sigma) + 1).all()


def test_colour_maps_follow_their_definition():
    factors = np.array([[1, 1, 1, 0], [1.3, 1, 1, 0], [1, 0.5, 1, 0], [1, 1, 0.2, 0.3], [1.1, 0.7, 1.4, -0.2]])
    on = np.ones(5, dtype=bool)
    maps = colour_maps(factors, on, ~on)
    apply = lambda k, rgb: maps[k, :, :3] @ np.asarray(rgb, dtype=np.float64) + maps[k, :, 3]  # noqa: E731
    np.testing.assert_allclose(maps[0], np.hstack([np.eye(3), np.zeros((3, 1))]), atol=1e-6)
    np.testing.assert_allclose(apply(1, [10, 20, 30]), [13, 26, 39], atol=1e-4)
    np.testing.assert_allclose(apply(2, [27.5, 227.5, 127.5]), [77.5, 177.5, 127.5], atol=1e-4)  # about mid-grey
    for k in (3, 4):  # saturation and hue keep greys grey and keep the luma
        np.testing.assert_allclose(apply(k, [90, 90, 90]), np.full(3, apply(k, [90, 90, 90])[0]), atol=1e-3)
    np.testing.assert_allclose(LUMA @ apply(3, [200, 50, 10]), LUMA @ np.array([200, 50, 10]), atol=1e-3)
    gray = colour_maps(factors, ~on, on)
    assert np.allclose(gray[:, :, :3], LUMA[None, None, :]) and np.allclose(gray[:, :, 3], 0)
    untouched = colour_maps(factors, ~on, ~on)
    assert np.allclose(untouched, np.hstack([np.eye(3), np.zeros((3, 1))]))
