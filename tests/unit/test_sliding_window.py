"""The sliding-window sampler (PIC, Algorithm 3): checked against a plain transcription of the
algorithm, for coverage of every id, rank splits and resharding, exact resume, the checkpoint
state and the auto sizes."""

import math

import numpy as np
import pytest

from data_pipeline.loading.loader_config import SamplerConfig
from data_pipeline.loading.samplers.sliding_window import SlidingWindowSampler, resolve_sizes

# (N, W, S, global batch): N % S == 0 and Bg | W; N % S != 0 and Bg not dividing W (batches straddle
# windows); W > N; many windows past N (wrap-around); Bg > W (a batch spans several windows).
CASES = [(96, 32, 8, 16), (100, 32, 12, 12), (20, 48, 8, 12), (50, 16, 6, 20), (200, 8, 3, 24)]
WORLD_SIZES = [1, 2, 4]


def transcribed_stream(num_samples, window, stride, seed, length):
    """The first ``length`` ids of the stream, written the slow, obvious way (Algorithm 3)."""
    perm = np.random.default_rng([seed, 0x5717]).permutation(num_samples).tolist()
    stream, s, k = [], 0, 0
    while len(stream) < length:
        ids = [perm[(s + i) % num_samples] for i in range(window)]
        order = np.random.default_rng([seed, 0x5717, k]).permutation(window)
        stream += [ids[j] for j in order]
        s, k = s + stride, k + 1
    return stream[:length]


def global_batches(sampler, epochs):
    """``[[ids of step 0 over all ranks], ...]`` over ``epochs`` epochs, in step order."""
    return [sampler.step(e, s).ids.ravel().tolist() for e in range(epochs) for s in range(sampler.steps_per_epoch)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("num_samples, window, stride, global_batch", CASES)
def test_sampler_matches_the_transcribed_algorithm(num_samples, window, stride, global_batch, world_size):
    sampler = SlidingWindowSampler(num_samples, world_size, global_batch // world_size, seed=7,
                                   window_size=window, stride=stride)
    epochs = 6
    assert sampler.steps_per_epoch == math.ceil(num_samples / global_batch)
    stream = transcribed_stream(num_samples, window, stride, 7, epochs * sampler.steps_per_epoch * global_batch)
    assert sum(global_batches(sampler, epochs), []) == stream
    one = sampler.step(epochs - 1, sampler.steps_per_epoch - 1)
    assert one.ids.shape == one.valid.shape == (world_size, global_batch // world_size)
    assert one.ids.dtype == np.int64 and one.valid.all() and one.global_valid == global_batch


@pytest.mark.parametrize("num_samples, window, stride", [(96, 32, 8), (100, 32, 12), (1437, 128, 16)])
def test_every_id_is_visited_once_the_window_has_slid_over_it(num_samples, window, stride):
    sampler = SlidingWindowSampler(num_samples, 1, 16, seed=3, window_size=window, stride=stride)
    steps_needed = math.ceil((math.ceil(num_samples / stride) + window // stride) * window / 16)
    stream = np.concatenate([sampler.step(g // sampler.steps_per_epoch, g % sampler.steps_per_epoch).ids.ravel()
                             for g in range(steps_needed)])
    seen = set()
    for k in range(len(stream) // window):
        seen |= set(stream[k * window:(k + 1) * window].tolist())
        # windows 0..k covered perm[0 : k*S + W]: exactly those ids have been read
        assert seen == set(sampler.perm[:min(num_samples, k * stride + window)].tolist())
    assert seen == set(range(num_samples))
    if num_samples % stride == 0 and window % stride == 0:  # one full turn: every id in exactly W/S windows
        counts = np.bincount(stream[:num_samples // stride * window], minlength=num_samples)
        assert (counts == window // stride).all()


@pytest.mark.parametrize("num_samples, window, stride, global_batch", CASES)
def test_ranks_split_the_global_batch_and_a_reshard_continues_identically(num_samples, window, stride, global_batch):
    samplers = [SlidingWindowSampler(num_samples, w, global_batch // w, seed=1, window_size=window, stride=stride)
                for w in WORLD_SIZES]
    sequences = [global_batches(s, 3) for s in samplers]
    assert sequences[0] == sequences[1] == sequences[2]
    four = samplers[2]
    for epoch in range(3):
        for step in range(four.steps_per_epoch):
            ids = four.step(epoch, step).ids  # rank r holds positions r*b .. (r+1)*b of the global batch
            first = (epoch * four.steps_per_epoch + step) * global_batch
            inside_one_window = first // window == (first + global_batch - 1) // window
            if window <= num_samples and inside_one_window:  # a window's ids are distinct: ranks are disjoint
                assert len(set(ids.ravel().tolist())) == ids.size


def test_any_step_is_computed_without_the_ones_before_it():
    reference = SlidingWindowSampler(1000, 2, 24, seed=4, window_size=64, stride=8)
    history = {(e, s): reference.step(e, s).ids.tolist() for e in range(3) for s in range(reference.steps_per_epoch)}
    rng = np.random.default_rng(0)
    for e, s in [(2, 20), (0, 0), (1, 7)] + [tuple(k) for k in rng.integers([0, 0], [3, 21], size=(20, 2))]:
        fresh = SlidingWindowSampler(1000, 2, 24, seed=4, window_size=64, stride=8)  # mid-window resume
        assert fresh.step(e, s).ids.tolist() == history[(e, s)]
        assert reference.step(e, s).ids.tolist() == history[(e, s)], "the window cache must not change results"


def test_state_is_checked_on_resume():
    sampler = SlidingWindowSampler(1000, 2, 16, seed=1, window_size=64, stride=8)
    state = sampler.state_dict()
    assert state == {"kind": "sliding_window", "num_samples": 1000, "seed": 1, "window_size": 64, "stride": 8,
                     "global_batch": 32}
    SlidingWindowSampler(1000, 2, 16, seed=1, window_size=64, stride=8).load_state_dict(state)
    SlidingWindowSampler(1000, 4, 8, seed=1, window_size=64, stride=8).load_state_dict(state)  # reshard
    mismatches = [({"window_size": 128}, r"window_size: checkpoint 64, now 128"),
                  ({"stride": 16}, r"stride: checkpoint 8, now 16"),
                  ({"seed": 2}, r"seed: checkpoint 1, now 2"),
                  ({"batch_size": 32}, r"global_batch: checkpoint 32, now 64")]
    for change, message in mismatches:
        settings = dict(num_samples=1000, world_size=2, batch_size=16, seed=1, window_size=64, stride=8) | change
        with pytest.raises(ValueError, match=message):
            SlidingWindowSampler(**settings).load_state_dict(state)
    with pytest.raises(ValueError, match="the checkpoint's sampler is 'epoch_permutation'"):
        sampler.load_state_dict(state | {"kind": "epoch_permutation"})


def test_auto_sizes():
    assert resolve_sizes(1_281_167, 4096) == (2**17, 2**14)  # ImageNet: N/W = 9.8, the paper's W
    imagenet = SlidingWindowSampler(1_281_167, 16, 256, seed=0)
    assert (imagenet.window_size, imagenet.stride, imagenet.perm.dtype) == (2**17, 2**14, np.int32)
    assert resolve_sizes(1437, 128) == (128, 16)  # 2**round(log2(143.7)) = 128
    assert resolve_sizes(1437, 512) == (512, 64)  # never below one global batch
    assert resolve_sizes(50_000_000, 4096) == (2**17, 2**14)  # capped
    assert resolve_sizes(5, 1) == (1, 1)
    assert resolve_sizes(1437, 128, window_size=100) == (100, 12)
    assert resolve_sizes(1437, 128, stride=5) == (128, 5)
    assert resolve_sizes(1437, 128, window_size=7, stride=7) == (7, 7)


def test_bad_values_are_explained():
    with pytest.raises(ValueError, match=r"data\.loader\.sampler\.stride=256 exceeds the window size 128"):
        SlidingWindowSampler(1437, 1, 128, stride=256)
    with pytest.raises(ValueError, match=r"data\.loader\.sampler\.window_size=-1 is invalid"):
        SlidingWindowSampler(1437, 1, 128, window_size=-1)
    with pytest.raises(ValueError, match=r"data\.loader\.sampler\.stride=-2 is invalid"):
        SlidingWindowSampler(1437, 1, 128, stride=-2)
    with pytest.raises(IndexError, match=r"step 12 is outside \[0, 12\)"):
        SlidingWindowSampler(1437, 1, 128).step(0, 12)
    with pytest.raises(ValueError, match=r"kind='sliding' is invalid: choose one of \('epoch_permutation', "):
        SamplerConfig(kind="sliding")
    with pytest.raises(ValueError, match=r"window_size=-1 is invalid"):
        SamplerConfig(kind="sliding_window", window_size=-1)
    with pytest.raises(ValueError, match=r"stride=-1 is invalid"):
        SamplerConfig(stride=-1)
    with pytest.raises(ValueError, match=r"stride=64 is invalid: use at most window_size=32"):
        SamplerConfig(kind="sliding_window", window_size=32, stride=64)


def test_the_loader_and_the_job_config_select_it(tmp_path):
    """The wiring: YAML -> LoaderConfig.sampler -> default_sampler (imports torch, lazily)."""
    from data_pipeline.loading.base_loader import default_sampler
    from data_pipeline.loading.samplers.epoch_permutation import EpochPermutationSampler
    from trainer.config import ConfigError, load_job_config

    path = tmp_path / "job.yaml"
    path.write_text("data: {train_shards: x, loader: {batch_size: 16, seed: 3, "
                    "sampler: {kind: sliding_window, window_size: 64}}}\n")
    loader = load_job_config(path).data.loader
    assert loader.sampler == SamplerConfig(kind="sliding_window", window_size=64, stride=0)
    train = default_sampler(1000, loader, world_size=2, train=True)
    assert isinstance(train, SlidingWindowSampler) and train.state_dict()["seed"] == 3
    assert (train.window_size, train.stride, train.global_batch) == (64, 8, 32)
    assert isinstance(default_sampler(1000, loader, world_size=2, train=False), EpochPermutationSampler)
    with pytest.raises(ConfigError, match=r"unknown field data\.loader\.sampler\.windows; did you mean "
                                          r"data\.loader\.sampler\.window_size\?"):
        load_job_config(path, overrides=["data.loader.sampler.windows=3"])
    with pytest.raises(ConfigError, match=r"data\.loader\.sampler\.kind='pic' is invalid: choose one of"):
        load_job_config(path, overrides=["data.loader.sampler.kind=pic"])
