"""Both loaders: they read what the sampler names, ids travel with their images, a resumed epoch
is bit-identical and reads nothing before its first step, both backends apply the same
augmentation, and bad samples are named by shard and key."""

import argparse
import io
import itertools
import shutil
import tarfile
from dataclasses import replace

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from data_pipeline.ingest.make_shards import decode_int64
from data_pipeline.loading.augment.augment_config import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig
from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.loader_config import LoaderConfig
from data_pipeline.loading.sample_reader import StepReader, UndecodableImageError
from data_pipeline.loading.samplers.epoch_permutation import EpochPermutationSampler
from data_pipeline.shardset.manifest import ShardManifest

pytestmark = pytest.mark.integration

CPU = torch.device("cpu")
BACKENDS = ["dali", "torch"]


def run_epoch(loader, epoch):
    batches = list(loader.epoch_batches(epoch))
    return batches, torch.cat([b.instance_ids for b in batches]), torch.cat([b.valid for b in batches])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("last_batch", ["pad", "drop"])
def test_two_ranks_see_every_instance_once_per_epoch(digits_shards, backend, last_batch):
    config = LoaderConfig(batch_size=64, backend=backend, num_threads=2, last_batch=last_batch,
                          augment=AugmentConfig(image_size=32))
    loaders = [build_loader(digits_shards, config, rank, 2, CPU, train=True) for rank in range(2)]
    expected_steps = 15 if last_batch == "pad" else 14  # 1797 samples, 128 per global step
    order_by_epoch = []
    for epoch in range(2):
        epoch_ids, per_rank, padding = [], [], []
        for rank, loader in enumerate(loaders):
            batches, ids, valid = run_epoch(loader, epoch)
            assert len(batches) == len(loader) == loader.steps_per_epoch == expected_steps
            for step, batch in enumerate(batches):
                assert batch.step == step and batch.view_kinds == ["global", "global"]
                assert [tuple(v.shape) for v in batch.views] == [(64, 3, 32, 32)] * 2
                assert all(v.dtype == torch.float32 for v in batch.views)
                assert batch.instance_ids.dtype == torch.int64 and batch.instance_ids.shape == (64,)
                planned = loader.sampler.step(epoch, step)
                assert batch.instance_ids.tolist() == planned.ids[rank].tolist()
                assert batch.valid.tolist() == planned.valid[rank].tolist()
                # the same on the host, for per-id logs that must not wait for the device
                assert batch.host_instance_ids.tolist() == batch.instance_ids.tolist()
                assert batch.host_valid.tolist() == batch.valid.tolist()
            epoch_ids.append(ids[valid])
            per_rank.append(batches)
            assert ids[valid].unique().numel() == int(valid.sum()), "an id is valid at most once per rank"
            padding.append(ids[~valid])
        for first, second in zip(*per_rank):
            assert first.global_valid == second.global_valid == int(first.valid.sum() + second.valid.sum())
        union = torch.cat(epoch_ids).sort().values
        if last_batch == "pad":
            assert union.tolist() == list(range(1797))
        else:
            assert len(union) == 2 * 14 * 64 and union.unique().numel() == len(union)
        assert set(epoch_ids[0].tolist()).isdisjoint(epoch_ids[1].tolist())
        assert set(torch.cat(padding).tolist()) <= set(union.tolist()), "padding repeats samples of the epoch"
        order_by_epoch.append(epoch_ids[0].tolist())
    assert order_by_epoch[0] != order_by_epoch[1], "sample order should change between epochs"


def stored_colors(shard_dir):
    """id -> (mean RGB of the stored image, label), read straight from the tars (nothing was
    skipped, so a sample's key is its id)."""
    manifest = ShardManifest.load(shard_dir)
    truth = {}
    for sample in wds.DataPipeline(wds.SimpleShardList(manifest.tar_paths(shard_dir)), wds.tarfile_to_samples()):
        rgb = np.asarray(Image.open(io.BytesIO(sample["jpg"])).convert("RGB"), dtype=np.float64)
        truth[int(sample["__key__"])] = (rgb.reshape(-1, 3).mean(axis=0), decode_int64(sample["cls"]))
    return truth


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_travel_with_their_images_and_views_are_normalised(color_shards, backend):
    """Every image is one solid colour, so any crop or flip of it must show that id's colour."""
    truth = stored_colors(color_shards)
    no_colour_change = AugmentConfig(image_size=16, jitter_prob=0, grayscale_prob=0, blur_prob=0, small_crops=1,
                                     small_size=8)
    config = LoaderConfig(batch_size=8, backend=backend, num_threads=1, augment=no_colour_change)
    mean = torch.tensor(IMAGENET_MEAN)[None, :, None, None]
    std = torch.tensor(IMAGENET_STD)[None, :, None, None]
    for train in (True, False):
        batches, ids, valid = run_epoch(build_loader(color_shards, config, 0, 1, CPU, train=train), 0)
        assert sorted(ids[valid].tolist()) == list(range(45))
        if not train:
            assert ids.tolist()[:45] == list(range(45)), "evaluation reads the stored order"
        for batch in batches:
            assert batch.view_kinds == (["global", "global", "small"] if train else ["global"])
            for view in batch.views:
                rgb = ((view * std + mean) * 255).mean(dim=(2, 3))
                for row, instance_id in enumerate(batch.instance_ids.tolist()):
                    colour, label = truth[instance_id]
                    assert np.abs(rgb[row].numpy() - colour).max() < 3, f"id {instance_id} carries another image"
                    if not train:
                        assert batch.labels[row].item() == label
            if train:
                assert [v.shape[-1] for v in batch.views] == [16, 16, 8]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_two_views_of_an_image_differ(digits_shards, backend):
    config = LoaderConfig(batch_size=32, backend=backend, num_threads=2, augment=AugmentConfig(image_size=32))
    batch = next(build_loader(digits_shards, config, 0, 1, CPU, train=True).epoch_batches(0))
    per_sample_gap = (batch.views[0] - batch.views[1]).abs().flatten(1).mean(dim=1)
    assert (per_sample_gap > 0.05).float().mean() > 0.9
    normalised = torch.cat([v.flatten() for v in batch.views])
    assert -3 < normalised.mean() < 3 and normalised.std() > 0.3


@pytest.fixture
def step_reads(tmp_path, monkeypatch):
    """Every ``StepReader.read`` as ``(epoch, step)``, DataLoader workers included (they fork
    after the patch; a file collects what each process reads)."""
    log = tmp_path / "reads.txt"
    original = StepReader.read

    def logged_read(self, epoch, step):
        with open(log, "a") as handle:
            handle.write(f"{epoch} {step}\n")
        return original(self, epoch, step)

    monkeypatch.setattr(StepReader, "read", logged_read)

    def reads(clear=False):
        found = [tuple(map(int, line.split())) for line in log.read_text().splitlines()] if log.exists() else []
        if clear:
            log.unlink(missing_ok=True)
        return found

    return reads


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resumed_epoch_is_bit_identical_and_reads_nothing_before_its_step(digits_shards, backend, step_reads):
    augment = AugmentConfig(image_size=32, small_crops=1, small_size=16)
    config = LoaderConfig(batch_size=64, backend=backend, num_threads=2, seed=3, augment=augment)
    uninterrupted = list(build_loader(digits_shards, config, 1, 2, CPU, train=True).epoch_batches(4))
    assert sorted(set(step_reads(clear=True))) == [(4, s) for s in range(15)]
    restarted = build_loader(digits_shards, config, 1, 2, CPU, train=True)  # a fresh process would build this
    resumed = list(restarted.epoch_batches(4, start_step=11))
    assert {epoch for epoch, _ in step_reads()} == {4} and min(step for _, step in step_reads()) == 11
    assert [b.step for b in resumed] == [11, 12, 13, 14]
    for expected, got in zip(uninterrupted[11:], resumed, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(expected.views, got.views, strict=True))
        assert torch.equal(expected.instance_ids, got.instance_ids) and torch.equal(expected.valid, got.valid)
        assert expected.global_valid == got.global_valid
    assert list(restarted.epoch_batches(4, start_step=15)) == []


@pytest.mark.parametrize("recipe", ["moco_v2", "byol"])  # byol: asymmetric views, the second one solarized
def test_both_backends_read_the_same_samples_and_apply_the_same_parameters(digits_shards, recipe):
    augment = AugmentConfig(image_size=32, recipe=recipe)
    loaders = {backend: build_loader(digits_shards, LoaderConfig(batch_size=64, backend=backend, num_threads=2,
                                                                 augment=augment),
                                     0, 1, CPU, train=True) for backend in BACKENDS}
    dali, fallback = (list(itertools.islice(loaders[b].epoch_batches(2, 5), 3)) for b in BACKENDS)
    for ours, theirs in zip(dali, fallback, strict=True):
        assert torch.equal(ours.instance_ids, theirs.instance_ids) and torch.equal(ours.valid, theirs.valid)
        assert ours.step == theirs.step and ours.global_valid == theirs.global_valid
        params = [loaders[b].reader.read(2, ours.step).views for b in BACKENDS]
        for a, b in zip(*params, strict=True):
            fields = ("crop", "flip", "colour", "blur", "sigma", "window", "solarize")
            assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in fields)
        solarized = sum(int(view.solarize.sum()) for view in params[0])
        assert (solarized > 0) == (recipe == "byol"), solarized
        # Same parameters, different decoder and resampler arithmetic: under a grey level on average.
        for a, b in zip(ours.views, theirs.views, strict=True):
            gap = (a - b).abs()
            assert gap.mean() < 0.02 and gap.flatten().quantile(0.99) < 0.2, (gap.mean(), gap.max())
    config = LoaderConfig(batch_size=64, num_threads=1, augment=AugmentConfig(image_size=28))
    dali, fallback = (
        next(build_loader(digits_shards, replace(config, backend=b), 0, 1, CPU, train=False).epoch_batches(0))
        for b in BACKENDS
    )
    assert torch.equal(dali.labels, fallback.labels) and torch.equal(dali.instance_ids, fallback.instance_ids)
    assert (dali.views[0] - fallback.views[0]).abs().mean() < 0.02


def test_dali_solarize_follows_byols_definition_on_the_flagged_samples():
    """DALI has no solarize operator; the loader's arithmetic against BYOL's definition on levels in
    [0, 1] (``x`` below 0.5, else ``1 - x``), on every level of 0..255, and only where flagged."""
    from nvidia.dali import fn, pipeline_def, types

    from data_pipeline.loading.dali_loader import solarize_where

    unit = np.arange(256) / 255.0
    expected = np.round(np.where(unit < 0.5, unit, 1.0 - unit) * 255.0).reshape(16, 16, 1).repeat(3, axis=2)
    image = np.arange(256, dtype=np.uint8).reshape(16, 16, 1).repeat(3, axis=2)
    batch = ([image, image], [np.array(True), np.array(False)])

    @pipeline_def(enable_conditionals=True, batch_size=2, num_threads=1, device_id=None)
    def solarizing():
        pixels, flags = fn.external_source(source=lambda: batch, num_outputs=2, batch=True,
                                           dtype=[types.UINT8, types.BOOL], ndim=[3, 0])
        return solarize_where(pixels, flags)

    pipeline = solarizing()
    pipeline.build()
    (out,) = pipeline.run()
    assert out.dtype == types.UINT8
    np.testing.assert_array_equal(out.at(0), expected)
    np.testing.assert_array_equal(out.at(1), image)


def test_a_sampler_for_another_world_is_refused(digits_shards):
    config = LoaderConfig(batch_size=64, backend="torch", num_threads=1, augment=AugmentConfig(image_size=32))
    with pytest.raises(ValueError, match="plans world_size=2, batch_size=64, the loader runs world_size=1"):
        build_loader(digits_shards, config, 0, 1, CPU, train=True, sampler=EpochPermutationSampler(1797, 2, 64))


def _break_sample(shard_dir, how):
    """Damage one image of the second shard in place; returns ``"<tar> key <key>"``."""
    tar_path = shard_dir / ShardManifest.load(shard_dir).shards[1].tar
    with tarfile.open(tar_path) as archive:
        member = [m for m in archive.getmembers() if m.name.endswith(".jpg")][-1]
        jpeg = archive.extractfile(member).read()
    blob = bytearray(tar_path.read_bytes())
    start = member.offset_data
    if how == "no image header":
        blob[start : start + 16] = bytes(16)
    elif how == "bad huffman table":  # the header still parses; only decoding fails
        counts = start + jpeg.index(b"\xff\xc4") + 5
        blob[counts : counts + 16] = bytes([255] * 16)
    elif how == "corrupt body":  # header intact; the second half of the scan data and the end marker zeroed
        scan = jpeg.index(b"\xff\xda")
        scan += 2 + int.from_bytes(jpeg[scan + 2 : scan + 4], "big")
        cut = scan + (len(jpeg) - scan) // 2
        blob[start + cut : start + len(jpeg)] = bytes(len(jpeg) - cut)
    else:  # a tar cut inside the image
        blob = blob[: start + 10]
    tar_path.write_bytes(bytes(blob))
    return f"{tar_path.name} key {member.name.split('.')[0]}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["no image header", "bad huffman table", "truncated tar"])
def test_a_bad_sample_is_named_by_shard_and_key(color_shards, tmp_path, backend, how):
    shard_dir = tmp_path / "shards"
    shutil.copytree(color_shards, shard_dir)
    where = _break_sample(shard_dir, how)
    config = LoaderConfig(batch_size=8, backend=backend, num_threads=1, augment=AugmentConfig(image_size=16))
    with pytest.raises((ValueError, RuntimeError, OSError), match=where):
        for _ in build_loader(shard_dir, config, 0, 1, CPU, train=True).epoch_batches(0):
            pass


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["no image header", "truncated tar"])
def test_with_on_bad_sample_skip_a_bad_sample_is_not_valid_and_named_and_the_rest_is_unchanged(
    color_shards, tmp_path, backend, how
):
    shard_dir = tmp_path / "shards"
    shutil.copytree(color_shards, shard_dir)
    where = _break_sample(shard_dir, how)
    bad_id = int(where.split(" key ")[1])
    config = LoaderConfig(
        batch_size=8, backend=backend, num_threads=1, augment=AugmentConfig(image_size=16), on_bad_sample="skip"
    )
    intact = build_loader(color_shards, replace(config, on_bad_sample="stop"), 0, 1, CPU, train=True)
    damaged = build_loader(shard_dir, config, 0, 1, CPU, train=True)
    skipped = []
    for good, batch in zip(intact.epoch_batches(0), damaged.epoch_batches(0), strict=True):
        assert torch.equal(batch.instance_ids, good.instance_ids)
        is_bad = batch.instance_ids == bad_id
        assert torch.equal(batch.valid, good.valid & ~is_bad)
        assert batch.host_valid.tolist() == batch.valid.tolist()  # a skipped sample is not valid on the host
        for view, good_view in zip(batch.views, good.views):
            assert torch.equal(view[~is_bad], good_view[~is_bad]) and view.isfinite().all()
        skipped += batch.skipped
    assert len(skipped) == 1 and skipped[0].startswith(where), skipped


def _damaged_copy(color_shards, directory, how):
    shutil.copytree(color_shards, directory)
    return _break_sample(directory, how)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_body_that_does_not_decode_stops_the_run_as_bad_input_naming_shard_and_key(
    color_shards, tmp_path, backend, monkeypatch, capsys
):
    """Without skip, a JPEG whose header reads but whose body does not decode is the data's fault:
    the command line prints the error in one line and exits 2 (BAD_INPUT, permanent), so a Job does
    not retry the same sample; DALI's failure on the whole batch included."""
    import trainer.cli
    from trainer.exit_codes import ExitCode

    where = _damaged_copy(color_shards, tmp_path / "shards", "corrupt body")
    config = LoaderConfig(batch_size=8, backend=backend, num_threads=1, augment=AugmentConfig(image_size=16))
    with pytest.raises(UndecodableImageError, match=where) as caught:
        for _ in build_loader(tmp_path / "shards", config, 0, 1, CPU, train=True).epoch_batches(0):
            pass

    def fails_like_the_loader(args):
        raise caught.value

    command = argparse.ArgumentParser()
    command.set_defaults(handler=fails_like_the_loader)
    monkeypatch.setattr(trainer.cli, "build_parser", lambda: command)
    assert trainer.cli.main([]) == ExitCode.BAD_INPUT, "a crash (exit 1) would be retried on the same sample"
    assert where in capsys.readouterr().err


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_body_that_does_not_decode_reads_as_the_blank_and_a_pass_from_mid_epoch_sees_the_same_stream(
    color_shards, tmp_path, backend
):
    """With skip, the sample is blanked exactly as one without an image header is (same views, not
    valid, named), and whether it is blank depends only on its bytes: a second pass of the same
    loader (the culprit known) started at the culprit's step and a fresh loader (a resumed process,
    nothing known) started the step before give the first pass's batches bit for bit."""
    where = _damaged_copy(color_shards, tmp_path / "corrupt", "corrupt body")
    _damaged_copy(color_shards, tmp_path / "headerless", "no image header")  # the same sample
    bad_id = int(where.split(" key ")[1])
    config = LoaderConfig(batch_size=8, backend=backend, num_threads=1, augment=AugmentConfig(image_size=16),
                          on_bad_sample="skip")
    loader = build_loader(tmp_path / "corrupt", config, 0, 1, CPU, train=True)
    # an epoch whose culprit comes after two steps, so that a pass can start mid-epoch before and at it
    epoch, bad_step = next((e, s) for e in range(20) for s in range(2, len(loader))
                           if bad_id in loader.sampler.step(e, s).ids[0])
    first = list(loader.epoch_batches(epoch))
    blanked = list(build_loader(tmp_path / "headerless", config, 0, 1, CPU, train=True).epoch_batches(epoch))
    for ours, reference in zip(first, blanked, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours.views, reference.views, strict=True))
        assert torch.equal(ours.valid, reference.valid) and torch.equal(ours.instance_ids, reference.instance_ids)
        assert len(ours.skipped) == len(reference.skipped)
    assert not first[bad_step].valid[first[bad_step].instance_ids == bad_id].any()
    assert [problem.split(": .jpg")[0] for b in first for problem in b.skipped] == [where]
    if backend == "dali":
        assert loader.pipelines_built == 2, "a pipeline whose decoder raised is rebuilt, not reset"
    fresh = build_loader(tmp_path / "corrupt", config, 0, 1, CPU, train=True)
    for again, start in ((loader, bad_step), (fresh, bad_step - 1)):
        resumed = list(again.epoch_batches(epoch, start_step=start))
        for ours, expected in zip(resumed, first[start:], strict=True):
            assert ours.step == expected.step and ours.skipped == expected.skipped
            assert all(torch.equal(a, b) for a, b in zip(ours.views, expected.views, strict=True))
            assert torch.equal(ours.valid, expected.valid) and torch.equal(ours.instance_ids, expected.instance_ids)
    if backend == "dali":
        assert loader.pipelines_built == 2, "the second pass read the known culprit as the blank: no failure"
    # Evaluation too: the inference view of the blank is mid-grey (128 of 255) in every channel.
    evaluation = build_loader(tmp_path / "corrupt", config, 0, 1, CPU, train=False)
    grey = ((128 / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD))[:, None, None]
    rows = [(b.views[0][b.instance_ids == bad_id], b.valid[b.instance_ids == bad_id]) for b in
            evaluation.epoch_batches(0)]
    views, valid = torch.cat([v for v, _ in rows]), torch.cat([m for _, m in rows])
    assert len(views) == 1 and not valid.any() and (views[0] - grey).abs().max() < 0.03


def test_dali_blames_the_sample_its_decoder_names_only_when_pil_cannot_decode_it_either(color_shards, tmp_path):
    """Skipping a sample PIL decodes would let a transient decoder failure change the stream; a DALI
    message that names no sample falls back to the first pending step with a sample PIL refuses."""
    from data_pipeline.loading.dali_loader import _culprits

    where = _damaged_copy(color_shards, tmp_path / "shards", "corrupt body")
    bad_id = int(where.split(" key ")[1])
    config = LoaderConfig(batch_size=8, backend="dali", num_threads=1, augment=AugmentConfig(image_size=16),
                          on_bad_sample="skip")
    reader = build_loader(tmp_path / "shards", config, 0, 1, CPU, train=True).reader
    step = next(s for s in range(1, 6) if bad_id in reader.sampler.step(0, s).ids[0])
    before, failed = (reader.read(0, s).samples for s in (step - 1, step))
    place = failed.ids.tolist().index(bad_id)
    found = _culprits(reader, [failed], RuntimeError(f"Error in CPU operator\nFailed to decode sample #{place} : "))
    assert found is not None and found[0] == step and list(found[1]) == [bad_id] and found[1][bad_id].startswith(where)
    other = (place + 1) % len(failed.ids)
    assert _culprits(reader, [failed], RuntimeError(f"Failed to decode sample #{other} : ")) is None
    assert _culprits(reader, [before, failed], RuntimeError("a message naming no sample")) == found


@pytest.mark.parametrize("train", [True, False])
def test_dali_builds_one_pipeline_per_loader_and_a_reused_one_reads_like_a_new_one(digits_shards, train):
    config = LoaderConfig(batch_size=256, backend="dali", num_threads=1, augment=AugmentConfig(image_size=24))
    reused = build_loader(digits_shards, config, 0, 1, CPU, train=train)
    passes = [list(reused.epoch_batches(0)), list(reused.epoch_batches(3, start_step=4)), list(reused.epoch_batches(1))]
    assert reused.pipelines_built == 1, "every pass ran to its end: the first pipeline serves them all"
    abandoned = reused.epoch_batches(2)
    next(abandoned)
    abandoned.close()  # look-ahead batches stay queued in DALI: that pipeline is not reused
    passes.append(list(reused.epoch_batches(2, start_step=5)))
    assert reused.pipelines_built == 2
    for (epoch, start), got in zip([(0, 0), (3, 4), (1, 0), (2, 5)], passes, strict=True):
        fresh = build_loader(digits_shards, config, 0, 1, CPU, train=train)
        expected = list(fresh.epoch_batches(epoch, start_step=start))
        assert [b.step for b in got] == [b.step for b in expected] == list(range(start, len(fresh)))
        for a, b in zip(expected, got, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a.views, b.views, strict=True))
            assert torch.equal(a.instance_ids, b.instance_ids) and torch.equal(a.valid, b.valid)


def test_a_training_set_smaller_than_one_global_batch_is_refused_with_the_fix(tmp_path):
    from data_pipeline.ingest.make_shards import ShardSettings, write_shards
    from data_pipeline.ingest.sources.generated import synthetic

    write_shards(synthetic(20, 16), tmp_path, ShardSettings(), progress=False)
    config = LoaderConfig(batch_size=64, backend="torch", num_threads=1, augment=AugmentConfig(image_size=16))
    with pytest.raises(
        ValueError,
        match=rf"{tmp_path} holds 20 samples, fewer than one global batch \(data.loader."
        r"batch_size 64 x 2 ranks = 128\): set data.loader.batch_size to at most 10",
    ):
        build_loader(tmp_path, config, 0, 2, CPU, train=True)
    assert len(build_loader(tmp_path, config, 0, 2, CPU, train=False)) == 1, "an evaluation set may be small"
    assert len(build_loader(tmp_path, replace(config, batch_size=10), 0, 2, CPU, train=True)) == 1


def test_dali_prepares_as_many_batches_ahead_as_the_config_says(digits_shards):
    from data_pipeline.loading.dali_loader import DaliLoader

    config = LoaderConfig(batch_size=16, backend="dali", num_threads=1, prefetch_depth=3,
                          augment=AugmentConfig(image_size=16))
    loader = build_loader(digits_shards, config, 0, 1, CPU, train=True)
    assert isinstance(loader, DaliLoader)
    pipeline, _ = loader._pipeline()
    assert pipeline.prefetch_queue_depth == 3
    with pytest.raises(ValueError, match="prefetch_depth=0 is invalid"):
        LoaderConfig(prefetch_depth=0)
