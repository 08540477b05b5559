"""Augmentation parameters: torchvision's crop rule, reproducible per (seed, epoch, sample id)
whatever batch or rank reads the sample, and colour maps that do what
``data_pipeline.loading.augment.colour`` says."""

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


FIELDS = ("crop", "flip", "colour", "blur", "sigma", "window")


def test_a_samples_parameters_depend_only_on_seed_epoch_and_its_id():
    """The same image gets the same views in a batch of 8 on one rank and in halves of 4 on two
    ranks, in any order (an elastic restart on another number of ranks); another epoch or seed
    draws others."""
    augment = AugmentConfig(image_size=32, small_crops=2, small_size=16)
    ids = np.array([5, 17, 2, 900, 41, 3, 77, 12])
    heights, widths = np.arange(40, 48), np.arange(50, 58)
    draw = lambda seed, epoch, rows: draw_views(augmentation_rng(seed, epoch, ids[rows]), heights[rows],  # noqa: E731
                                                widths[rows], augment)
    whole = draw(0, 1, np.arange(8))
    assert [v.size for v in whole] == [32, 32, 16, 16]
    for rows in (np.arange(4), np.arange(4, 8), np.array([6, 1, 7, 0])):
        for part, full in zip(draw(0, 1, rows), whole):
            assert all(np.array_equal(getattr(part, f), getattr(full, f)[rows]) for f in FIELDS)
    for other in (draw(0, 2, np.arange(8)), draw(1, 1, np.arange(8))):
        assert not np.array_equal(other[0].colour, whole[0].colour)
    assert (whole[0].window == 2 * np.ceil(3 * whole[0].sigma) + 1).all()
    assert not np.array_equal(whole[0].colour, whole[1].colour)  # the two views of an image differ


def test_sample_streams_are_uniform_and_independent_of_neighbours():
    streams = augmentation_rng(0, 0, np.arange(20000))
    first, second = streams.random((20000, 2)).T
    assert 0 <= first.min() and first.max() < 1
    assert abs(first.mean() - 0.5) < 0.01 and abs(first.var() - 1 / 12) < 0.005
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.03  # two draws of a sample
    assert abs(np.corrcoef(first[:-1], first[1:])[0, 1]) < 0.03  # neighbouring ids
    low, high = np.array([1.0, -2.0]), np.array([3.0, 2.0])
    values = augmentation_rng(0, 0, np.arange(1000)).uniform(low, high, (1000, 2))
    assert (values >= low).all() and (values < high).all()


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
