"""Augmentation recipes by name: each entry holds its paper's numbers, the default is MoCo v2's "aug+"
(what every config trained with before recipes had names), a config field replaces a recipe value on
every view, per-view probabilities reach the views they name, solarize does what BYOL defines, and
an unknown name is refused naming the field and the known names."""

import numpy as np
import pytest
import torch

from data_pipeline.loading.augment.augment_config import AugmentConfig
from data_pipeline.loading.augment.colour import colour_maps
from data_pipeline.loading.augment.recipes import DEFAULT_RECIPE, RECIPES, ViewProbabilities
from data_pipeline.loading.augment.view_params import augmentation_rng, crop_boxes, draw_views
from data_pipeline.loading.torchvision_loader import solarize
from trainer.config import JobConfig
from trainer.config_building import ConfigError, build_dataclass

# The papers' numbers, written out from them: crop area, jitter (brightness, contrast, saturation, hue),
# then per view (jitter p, grayscale p, blur p, solarize p).  Flip 0.5 and blur sigma 0.1-2 in all three.
PAPERS = {
    # MoCo v2, Section 3 "aug+" and main_moco.py --aug-plus
    "moco_v2": ((0.2, 1.0), (0.4, 0.4, 0.4, 0.1), [(0.8, 0.2, 0.5, 0.0)]),
    # SimCLR, Appendix A: colour distortion of strength 1 is (0.8, 0.8, 0.8, 0.2)
    "simclr": ((0.08, 1.0), (0.8, 0.8, 0.8, 0.2), [(0.8, 0.2, 0.5, 0.0)]),
    # BYOL, Table 6: blur 1.0 / 0.1 and solarization 0.0 / 0.2 on its two views
    "byol": ((0.08, 1.0), (0.4, 0.4, 0.2, 0.1), [(0.8, 0.2, 1.0, 0.0), (0.8, 0.2, 0.1, 0.2)]),
}


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_each_recipe_holds_its_papers_numbers_and_names_the_paper(name):
    recipe, (crop, jitter, views) = RECIPES[name], PAPERS[name]
    assert (recipe.crop_scale, recipe.jitter, recipe.flip_prob, recipe.blur_sigma) == (crop, jitter, 0.5, (0.1, 2.0))
    assert [(v.jitter, v.grayscale, v.blur, v.solarize) for v in recipe.views] == views
    assert recipe.source.lower().startswith(name.replace("_", " ")) and "arXiv" in recipe.source


def test_an_unset_recipe_is_todays_augmentation():
    """The values every shipped config trained with before recipes existed."""
    assert DEFAULT_RECIPE == "moco_v2"
    recipe = AugmentConfig().effective_recipe()
    assert (recipe.crop_scale, recipe.jitter, recipe.flip_prob, recipe.blur_sigma) == (
        (0.2, 1.0), (0.4, 0.4, 0.4, 0.1), 0.5, (0.1, 2.0))
    assert recipe.views == (ViewProbabilities(jitter=0.8, grayscale=0.2, blur=0.5, solarize=0.0),)


def test_a_field_set_in_the_config_replaces_the_recipes_value_on_every_view():
    augment = AugmentConfig(recipe="byol", crop_scale=(0.5, 1.0), flip_prob=0.0, blur_prob=0.3, jitter=(0, 0, 0, 0))
    recipe = augment.effective_recipe()
    assert (recipe.crop_scale, recipe.flip_prob, recipe.jitter) == ((0.5, 1.0), 0.0, (0, 0, 0, 0))
    assert [(v.blur, v.solarize) for v in recipe.views] == [(0.3, 0.0), (0.3, 0.2)], "solarize stays byol's"
    assert augment.view_specs()[0] == (224, (0.5, 1.0))
    assert RECIPES["byol"].crop_scale == (0.08, 1.0), "the table itself is untouched"


def _draw(augment, count=4000, seed=0):
    ids = np.arange(count)
    sides = np.full(count, 64)
    return draw_views(augmentation_rng(seed, 1, ids), sides, sides, augment)


def test_per_view_probabilities_reach_their_views():
    """BYOL blurs its first view always and its second one in ten, and solarizes only the second, one
    in five; a third view (multi-crop) takes the first view's again."""
    views = _draw(AugmentConfig(recipe="byol", image_size=32, small_crops=1, small_size=16))
    assert views[0].blur.all() and not views[0].solarize.any()
    assert abs(views[1].blur.mean() - 0.1) < 0.02 and abs(views[1].solarize.mean() - 0.2) < 0.02
    assert views[2].blur.all() and not views[2].solarize.any()


def test_the_default_recipe_draws_what_it_drew_before_solarize_existed():
    """Runs resumed across this change see the same views: per view, the stream gives crop, flip,
    jitter flag, jitter factors, grayscale flag, blur flag and sigma in that order, as before, and
    the solarize flags only come after every view's."""
    count, sides = 300, np.full(300, 64)
    ids = np.arange(count)
    stream = augmentation_rng(0, 1, ids)
    low, high = np.array([0.6, 0.6, 0.6, -0.1]), np.array([1.4, 1.4, 1.4, 0.1])  # jitter 0.4, 0.4, 0.4, 0.1
    for view in draw_views(augmentation_rng(0, 1, ids), sides, sides, AugmentConfig(image_size=32)):
        assert np.array_equal(view.crop, crop_boxes(stream, sides, sides, (0.2, 1.0)))
        assert np.array_equal(view.flip, stream.random(count) < 0.5)
        jitter = stream.random(count) < 0.8
        factors = stream.uniform(low, high, (count, 4))
        assert np.array_equal(view.colour, colour_maps(factors, jitter, stream.random(count) < 0.2))
        assert np.array_equal(view.blur, stream.random(count) < 0.5)
        assert np.array_equal(view.sigma, stream.uniform(0.1, 2.0, count).astype(np.float32))
        assert not view.solarize.any()


def test_turning_solarize_on_changes_only_the_solarize_flags():
    plain = _draw(AugmentConfig(image_size=32), count=500)
    solarizing = _draw(AugmentConfig(image_size=32, solarize_prob=0.5), count=500)
    for a, b in zip(plain, solarizing, strict=True):
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("crop", "flip", "colour", "blur", "sigma"))
        assert not a.solarize.any() and 0.4 < b.solarize.mean() < 0.6


def test_torch_solarize_follows_byols_definition():
    """BYOL on levels in [0, 1]: ``x`` below 0.5, else ``1 - x``; here on every level of 0..255."""
    levels = np.arange(256)
    unit = levels / 255.0
    expected = np.round(np.where(unit < 0.5, unit, 1.0 - unit) * 255.0)  # float64 reference
    image = torch.from_numpy(np.stack([levels, levels[::-1], levels]).astype(np.uint8))[:, None, :]
    got = solarize(image)
    assert got.dtype == torch.uint8
    np.testing.assert_array_equal(got[0, 0].numpy(), expected)
    np.testing.assert_array_equal(got[1, 0].numpy(), expected[::-1])


def _job(augment: dict, objective: str = "instance") -> JobConfig:
    return build_dataclass(JobConfig, {"data": {"train_shards": "shards", "loader": {"augment": augment}},
                                       "objective": {"name": objective}}, "")


def test_an_unknown_recipe_is_refused_naming_the_field_and_the_known_ones():
    with pytest.raises(ConfigError, match=r"data\.loader\.augment\.recipe='simclr_v3' is invalid: choose one of "
                                          r"moco_v2, simclr, byol"):
        _job({"recipe": "simclr_v3"})


@pytest.mark.parametrize("objective", ["instance", "pic", "swav"])
def test_a_job_without_a_recipe_takes_its_objectives(objective, monkeypatch):
    assert _job({}, objective).data.loader.augment.recipe == "moco_v2"
    assert _job({"recipe": "simclr"}, objective).data.loader.augment.recipe == "simclr", "an explicit one is kept"
    config_class = type(_job({}, objective).objective)
    monkeypatch.setattr(config_class, "default_recipe", lambda self: "byol")
    assert _job({}, objective).data.loader.augment.recipe == "byol"
