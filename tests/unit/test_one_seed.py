"""One seed drives a run: ``seed`` sets the initial weights and, unless ``data.loader.seed`` is set,
the data order and every augmentation parameter; a resumed run keeps the loader seed its
checkpoint's sampler recorded (checkpoints written when it defaulted to 0 resume as they did)."""

import numpy as np
import pytest
import torch

from data_pipeline.loading.augment.view_params import augmentation_rng, draw_views
from data_pipeline.loading.base_loader import default_sampler
from tests.helpers.training import REPO
from trainer.config import ConfigError, load_job_config
from trainer.engine.resumed_settings import recorded_loader_seed, settings_for_this_run

DEMO = REPO / "configs" / "demo_cpu.yaml"
SAMPLES = 1000


def _config(tmp_path, *overrides):
    return load_job_config(DEMO, [f"data.train_shards={tmp_path}", *overrides])


def _first_step(config):
    """The ids the first step reads and its first view's crops and colour maps, as the loader draws them."""
    loader = config.data.loader
    ids = default_sampler(SAMPLES, loader, 2, train=True).step(0, 0).ids.ravel()
    sides = np.full(ids.shape, 32)
    view = draw_views(augmentation_rng(loader.sample_seed, 0, ids), sides, sides, loader.augment)[0]
    return ids, view.crop, view.colour


def test_another_seed_changes_the_data_order_and_the_views(tmp_path):
    first, second = _config(tmp_path, "seed=0"), _config(tmp_path, "seed=1")
    assert (first.data.loader.seed, second.data.loader.seed) == (0, 1)
    (ids_a, crop_a, colour_a), (ids_b, crop_b, colour_b) = _first_step(first), _first_step(second)
    assert not np.array_equal(ids_a, ids_b), "the data order follows seed"
    assert not np.array_equal(colour_a, colour_b) and not np.array_equal(crop_a, crop_b)
    # the same images, too, get other views: augmentation is keyed by (loader seed, epoch, id)
    sides = np.full(ids_a.shape, 32)
    same_ids = [draw_views(augmentation_rng(config.data.loader.sample_seed, 0, ids_a), sides, sides,
                           config.data.loader.augment)[0] for config in (first, second)]
    assert not np.array_equal(same_ids[0].crop, same_ids[1].crop)


def test_an_explicit_loader_seed_is_kept_and_a_bad_one_refused(tmp_path):
    config = _config(tmp_path, "seed=4", "data.loader.seed=9")
    assert (config.seed, config.data.loader.seed) == (4, 9)
    assert np.array_equal(_first_step(config)[0], _first_step(_config(tmp_path, "seed=0", "data.loader.seed=9"))[0])
    with pytest.raises(ConfigError, match=r"data\.loader\.seed=-1 is invalid"):
        _config(tmp_path, "data.loader.seed=-1")
    with pytest.raises(ConfigError, match=r"seed=-2 is invalid"):
        _config(tmp_path, "seed=-2")


def _checkpoint_with_sampler_seed(tmp_path, seed):
    folder = tmp_path / "step_000000004" / "components" / "sampler"
    folder.mkdir(parents=True)
    state = {"kind": "epoch_permutation", "num_samples": SAMPLES, "shuffle": True, "global_batch": 64,
             "last_batch": "pad"}
    if seed is not None:
        state["seed"] = seed
    torch.save(state, folder / "rank-00000.pt")
    return tmp_path / "step_000000004"


def test_a_resume_keeps_the_loader_seed_its_checkpoint_recorded(tmp_path):
    """A checkpoint written when data.loader.seed defaulted to 0, resumed by a job whose seed is 3:
    the data order and views go on from seed 0, said once; a fresh start takes the job's seed."""
    config = _config(tmp_path, "seed=3")
    old = _checkpoint_with_sampler_seed(tmp_path / "old", 0)
    meta = {"global_batch": config.data.loader.batch_size * 2, "world_size": 2}
    resumed = settings_for_this_run(config, 2, old, meta)
    assert resumed.config.data.loader.seed == 0 and resumed.config.seed == 3
    assert any("data.loader.seed 0, the checkpoint's, not 3" in note for note in resumed.notes), resumed.notes
    fresh = settings_for_this_run(config, 2, None, None)
    assert fresh.config.data.loader.seed == 3 and fresh.notes == ()
    same = settings_for_this_run(config, 2, _checkpoint_with_sampler_seed(tmp_path / "same", 3), meta)
    assert same.config.data.loader.seed == 3 and not any("seed" in note for note in same.notes)
    assert recorded_loader_seed(_checkpoint_with_sampler_seed(tmp_path / "none", None)) is None
