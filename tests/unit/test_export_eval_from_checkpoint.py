"""`instcls export` and `instcls eval` from a checkpoint alone: its ``run.json`` holds the run's
resolved config, so neither needs the YAML and the --set values the run was trained with.  A
--config (or --set) given beside it may change paths and evaluation settings, not the network: a
differing architecture field is refused, naming it and both values.  The kNN bank (the training
shards by default) is compared with the recorded training data by manifest digest, not by path: the
same shard set under another mount path is accepted, another shard set refused unless it is named
as the bank on purpose.  A checkpoint from before run.json needs --config, and says so."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.sources.files import image_folder
from tests.helpers.checkpoints import trained_like, write_checkpoint, write_job, write_shards_manifest
from trainer.cli import main
from trainer.config import load_job_config
from trainer.provenance import collect_provenance, write_provenance

RESNET10 = {"arch": "resnet10", "small_input_stem": True}
# The evaluation of the jobs here: one rank on the CPU, the plain torch loader in this process.
EVAL_DATA = {"loader": {"backend": "torch", "num_threads": 1, "batch_size": 16}}


def _recorded_run(folder, shards, eval_shards=None, model=None):
    """A job trained on ``shards`` and its checkpoint with the run's ``run.json``, as the trainer
    leaves them: (config path, checkpoint)."""
    path, _ = write_job(folder, model or RESNET10, shards)
    data = yaml.safe_load(path.read_text())
    data["data"].update(EVAL_DATA | ({"eval_shards": str(eval_shards)} if eval_shards else {}))
    data["data"]["loader"]["augment"] = {"image_size": 32}
    path.write_text(yaml.safe_dump(data))
    config = load_job_config(path)
    checkpoint = write_checkpoint(config, trained_like(config))
    write_provenance(checkpoint, collect_provenance(config, path, [], 1, ["host"], "run-token"))
    return path, checkpoint


def _files(folder) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(folder.iterdir())}


def _error(capsys) -> str:
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error  # one line for the user, no traceback
    return error


def test_export_from_the_checkpoint_alone_writes_what_export_with_its_config_writes(tmp_path, capsys):
    path, checkpoint = _recorded_run(tmp_path / "run", write_shards_manifest(tmp_path / "shards", images=100))
    out = tmp_path / "export"
    assert main(["export", "--config", str(path), "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    with_config = _files(out)
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out), "--force"]) == 0
    assert sorted(with_config) == ["README.md", "config.json", "model.safetensors", "run.json"]
    assert _files(out) == with_config  # byte for byte: the weights, the config.json and the model card
    assert f"exported the backbone of {checkpoint} to {out}" in capsys.readouterr().out


@pytest.mark.parametrize("given", ["config", "set"])
def test_a_network_field_that_differs_from_the_checkpoints_record_is_refused_naming_it(given, tmp_path, capsys):
    path, checkpoint = _recorded_run(tmp_path / "run", write_shards_manifest(tmp_path / "shards", images=100))
    if given == "config":  # another job file whose head is wider
        other, _ = write_job(tmp_path / "other", {**RESNET10, "feature_dim": 16}, tmp_path / "shards")
        options, source = ["--config", str(other)], f"--config {other}"
    else:
        options, source = ["--set", "model.feature_dim=16"], "--set model.feature_dim=16"
    for command in (["export", "--out", str(tmp_path / "out")], ["eval", "knn"]):
        assert main([*command, "--checkpoint", str(checkpoint), *options]) == 2
        assert (f"model.feature_dim is 8 in checkpoint {checkpoint} (run.json) and 16 in {source}: that is another "
                "network") in _error(capsys)
    assert not (tmp_path / "out").exists()


def test_a_setting_that_leaves_the_network_as_it_is_may_differ(tmp_path, capsys):
    """Paths, logging and how the network trains are the given config's to choose."""
    path, checkpoint = _recorded_run(tmp_path / "run", write_shards_manifest(tmp_path / "shards", images=100))
    settings = ["model.channels_last=true", "model.batch_norm=sync", f"logging.dir={tmp_path / 'elsewhere'}",
                "checkpoint.dir=/nowhere"]
    options = [item for setting in settings for item in ("--set", setting)]
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "a"), *options]) == 0
    assert main(["export", "--config", str(path), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "b"),
                 *options]) == 0


def test_a_checkpoint_without_run_json_needs_config_and_says_so(tmp_path, capsys):
    path, config = write_job(tmp_path / "run", RESNET10, write_shards_manifest(tmp_path / "shards", images=100))
    checkpoint = write_checkpoint(config, trained_like(config))  # as written before runs recorded run.json
    for command in (["export", "--out", str(tmp_path / "out")], ["eval", "knn"]):
        assert main([*command, "--checkpoint", str(checkpoint)]) == 2
        assert (f"checkpoint {checkpoint} has no run.json holding its config (it was written before runs recorded "
                "one): pass --config FILE with the run's config") in _error(capsys)
    assert main(["export", "--config", str(path), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")]) == 0


def test_auto_and_random_init_without_config_say_what_is_needed(tmp_path, capsys):
    assert main(["export", "--checkpoint", "auto", "--out", str(tmp_path / "out")]) == 2
    assert "--checkpoint auto takes the newest complete checkpoint in the config's checkpoint.dir: add --config " \
           "FILE, or name the checkpoint folder" in _error(capsys)
    assert main(["eval", "knn", "--checkpoint", "random-init"]) == 2
    assert "--checkpoint random-init builds the untrained network from the config's seed: pass --config FILE" \
        in _error(capsys)


def _knn(capsys, *arguments) -> tuple[str, str]:
    """`instcls eval knn` in this process: (accuracy, held-out features digest) as printed."""
    assert main(["eval", "knn", *arguments]) == 0, capsys.readouterr().err
    found = re.search(r"accuracy of .*: [0-9.]+% \(([0-9.e-]+); held-out features digest ([0-9a-f]{16})\)",
                      capsys.readouterr().out)
    assert found
    return found.group(1), found.group(2)


@pytest.fixture
def colors_run(color_shards, tmp_path):
    """A run trained on a copy of the colour shards (its held-out set too): (config path, checkpoint,
    the shards' path)."""
    shards = tmp_path / "mnt-a" / "colors"
    shutil.copytree(color_shards, shards)
    # the standard stem: a 32 px image is 8 x 8 after it, and an evaluation takes a fraction of a second
    path, checkpoint = _recorded_run(tmp_path / "run", shards, eval_shards=shards, model={"arch": "resnet10"})
    return path, checkpoint, shards


def test_eval_from_the_checkpoint_alone_scores_what_eval_with_its_config_scores(colors_run, tmp_path, capsys):
    path, checkpoint, shards = colors_run
    with_config = _knn(capsys, "--config", str(path), "--checkpoint", str(checkpoint))
    assert _knn(capsys, "--checkpoint", str(checkpoint)) == with_config

    moved = tmp_path / "mnt-b" / "colors"  # the same shard set where another machine mounts it
    moved.parent.mkdir()
    shards.rename(moved)
    assert main(["eval", "knn", "--checkpoint", str(checkpoint)]) == 2  # the recorded path is gone here
    assert f"data.train_shards={shards} (the kNN bank, as data.knn_bank_shards is unset) has no manifest.json " \
           "here: pass --set data.train_shards=PATH" in _error(capsys)
    at_new_path = ["--set", f"data.train_shards={moved}", "--set", f"data.eval_shards={moved}"]
    assert _knn(capsys, "--checkpoint", str(checkpoint), *at_new_path) == with_config
    # a config file given beside it, with the new paths, scores the same
    assert _knn(capsys, "--config", str(path), "--checkpoint", str(checkpoint), *at_new_path) == with_config


def test_another_shard_set_as_the_bank_is_refused_unless_named_as_the_bank(colors_run, color_folder, tmp_path,
                                                                          capsys):
    _, checkpoint, shards = colors_run
    resharded = tmp_path / "resharded"  # the same images in other shards: another manifest
    write_shards(image_folder(color_folder, labels=True), resharded, ShardSettings(prefix="colors",
                                                                                   samples_per_shard=15),
                 progress=False)
    assert main(["eval", "knn", "--checkpoint", str(checkpoint), "--set", f"data.train_shards={resharded}"]) == 2
    error = _error(capsys)
    assert re.search(rf"data\.train_shards={re.escape(str(resharded))} holds other shards than checkpoint "
                     rf"{re.escape(str(checkpoint))} was trained on \(manifest sha256:[0-9a-f]{{64}} here, "
                     r"sha256:[0-9a-f]{64} in its run\.json\)", error), error
    assert "data.knn_bank_shards=PATH" in error
    # another held-out set and another bank, each chosen on purpose, are evaluated
    _knn(capsys, "--checkpoint", str(checkpoint), "--set", f"data.knn_bank_shards={resharded}",
         "--set", f"data.eval_shards={resharded}")
