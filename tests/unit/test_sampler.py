"""The sampler seam: which ids every rank reads at each step, checked against a plain transcription
of the rules (permutation per epoch, one global batch per step split over the ranks, pad by
wrapping, drop the rest)."""

import math

import numpy as np
import pytest

from data_pipeline.loading.samplers.base import steps_per_epoch
from data_pipeline.loading.samplers.epoch_permutation import EpochPermutationSampler

WORLD_SIZES = [1, 2, 3]


def transcribed_epoch(num_samples, world_size, batch, seed, epoch, last_batch, shuffle=True):
    """``plan[rank][step] = [(id, valid), ...]``, written the slow, obvious way."""
    order = (
        np.random.default_rng([seed, epoch]).permutation(num_samples).tolist() if shuffle else list(range(num_samples))
    )
    global_batch = world_size * batch
    steps = math.ceil(num_samples / global_batch) if last_batch == "pad" else num_samples // global_batch
    plan = [[] for _ in range(world_size)]
    for step in range(steps):
        for rank in range(world_size):
            first = step * global_batch + rank * batch
            positions = range(first, first + batch)
            plan[rank].append([(order[p % num_samples], p < num_samples) for p in positions])
    return plan


def epoch_table(sampler, epoch):
    steps = [sampler.step(epoch, s) for s in range(sampler.steps_per_epoch)]
    return np.stack([s.ids for s in steps], axis=1), np.stack([s.valid for s in steps], axis=1), steps


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("last_batch", ["pad", "drop"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_matches_the_transcribed_rules(world_size, last_batch, shuffle):
    sampler = EpochPermutationSampler(103, world_size, 8, seed=5, shuffle=shuffle, last_batch=last_batch)
    for epoch in (0, 7):
        plan = transcribed_epoch(103, world_size, 8, 5, epoch, last_batch, shuffle)
        assert sampler.steps_per_epoch == len(plan[0])
        ids, valid, _ = epoch_table(sampler, epoch)  # [world, steps, batch]
        assert ids.dtype == np.int64 and valid.dtype == bool
        assert ids.tolist() == [[[i for i, _ in step] for step in rank] for rank in plan]
        assert valid.tolist() == [[[v for _, v in step] for step in rank] for rank in plan]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_padded_epochs_make_every_id_valid_exactly_once(world_size):
    sampler = EpochPermutationSampler(1797, world_size, 64, seed=0)
    orders = []
    for epoch in range(2):
        ids, valid, steps = epoch_table(sampler, epoch)
        assert sorted(ids[valid].tolist()) == list(range(1797))
        per_rank = [set(ids[r][valid[r]].tolist()) for r in range(world_size)]
        assert sum(len(s) for s in per_rank) == len(set().union(*per_rank)), "ranks must read disjoint ids"
        assert set(ids[~valid].tolist()) <= set(ids[valid].tolist()), "padding only repeats samples of the epoch"
        assert [s.global_valid for s in steps] == valid.sum(axis=(0, 2)).tolist()
        orders.append(ids[0].ravel().tolist())
    assert orders[0] != orders[1], "the order must change between epochs"
    again = EpochPermutationSampler(1797, world_size, 64, seed=0)
    assert epoch_table(again, 1)[0][0].ravel().tolist() == orders[1], "an epoch is reproducible on its own"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dropped_epochs_have_only_full_distinct_valid_steps(world_size):
    sampler = EpochPermutationSampler(1797, world_size, 64, seed=0, last_batch="drop")
    ids, valid, _ = epoch_table(sampler, 0)
    assert valid.all()
    assert sampler.steps_per_epoch == 1797 // (world_size * 64)
    assert len(np.unique(ids)) == ids.size == world_size * sampler.steps_per_epoch * 64


def test_eval_order_is_the_stored_order():
    sampler = EpochPermutationSampler(10, 2, 4, shuffle=False)
    ids, valid, _ = epoch_table(sampler, 3)
    assert ids.tolist() == [[[0, 1, 2, 3], [8, 9, 0, 1]], [[4, 5, 6, 7], [2, 3, 4, 5]]]
    assert valid.tolist() == [[[True] * 4, [True, True, False, False]], [[True] * 4, [False] * 4]]


def test_state_is_checked_on_resume():
    sampler = EpochPermutationSampler(100, 2, 8, seed=1)
    state = sampler.state_dict()
    EpochPermutationSampler(100, 2, 8, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seed: checkpoint 1, now 2\); these define which samples"):
        EpochPermutationSampler(100, 2, 8, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"global_batch: checkpoint 16, now 32\).*keep the global batch"):
        EpochPermutationSampler(100, 4, 8, seed=1).load_state_dict(state)
    EpochPermutationSampler(100, 4, 4, seed=1).load_state_dict(state)  # other ranks, same global batch
    with pytest.raises(ValueError, match="the checkpoint's sampler is 'sliding_window'"):
        sampler.load_state_dict(state | {"kind": "sliding_window"})


def test_the_global_batch_of_a_step_does_not_depend_on_the_world_size():
    """What makes a mid-epoch reshard exact: 4 ranks x 8 read what 1 rank x 32 reads."""
    four, one = EpochPermutationSampler(100, 4, 8, seed=1), EpochPermutationSampler(100, 1, 32, seed=1)
    assert four.steps_per_epoch == one.steps_per_epoch == 4
    for step in range(4):
        a, b = four.step(2, step), one.step(2, step)
        assert a.ids.ravel().tolist() == b.ids.ravel().tolist() and a.valid.ravel().tolist() == b.valid.ravel().tolist()


def test_bad_steps_and_too_little_data_are_explained():
    with pytest.raises(IndexError, match=r"step 13 is outside \[0, 13\)"):
        EpochPermutationSampler(100, 1, 8).step(0, 13)
    with pytest.raises(ValueError, match="use fewer ranks, a smaller batch"):
        steps_per_epoch(num_samples=100, world_size=4, batch_size=64, last_batch="drop")
    assert steps_per_epoch(num_samples=100, world_size=4, batch_size=64, last_batch="pad") == 1
