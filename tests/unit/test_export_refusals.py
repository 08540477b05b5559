"""What `instcls export` refuses, each with a message naming the thing and the fix, and without
touching what is already there: a non-empty output folder (unless --force, which replaces it whole),
a checkpoint of another job's network, an entry with no export mapping, a model.pt whose backbone
names differ from the library network's.  ``--with-head`` writes a head that loads strictly into
instcls's head module; the command line answers exit code 2 with one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.checkpoints import trained_like, write_checkpoint, write_job
from trainer.cli import main
from trainer.export import export_checkpoint
from trainer.models.backbones import Backbone, get_backbone, registry
from trainer.models.backbones.resnet import build_resnet, resnet_blocks

RESNET10 = {"arch": "resnet10", "small_input_stem": True}


@pytest.fixture
def run(tmp_path):
    """A ResNet-10 job and one checkpoint of it: (config path, config, model, checkpoint)."""
    path, config = write_job(tmp_path / "run", RESNET10)
    model = trained_like(config)
    return path, config, model, write_checkpoint(config, model)


def test_a_nonempty_output_folder_is_refused_and_kept_unless_force_replaces_it(run, tmp_path):
    _, config, _, checkpoint = run
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"--out .*out is not empty: .*--force"):
        export_checkpoint(config, checkpoint, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    export_checkpoint(config, checkpoint, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temp or set-aside folder left
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_checkpoint(config, checkpoint, empty) == empty  # an empty folder is not refused


def test_a_checkpoint_of_another_network_is_refused_naming_the_field(run, tmp_path):
    _, config, _, checkpoint = run
    _, other = write_job(tmp_path / "other", {"arch": "resnet10", "small_input_stem": False})
    with pytest.raises(ValueError, match=r"model\.small_input_stem is True there and False here"):
        export_checkpoint(other, checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_backbone_whose_names_differ_from_the_library_network_is_refused_naming_the_first(run, tmp_path):
    _, config, model, _ = run
    state = model.state_dict()
    state["backbone.fc.weight"] = torch.zeros(3, 512)  # a classification layer the exported network lacks
    renamed = {("backbone.stem." + key[len("backbone."):] if key == "backbone.conv1.weight" else key): value
               for key, value in state.items()}
    for bad, message in ((state, r"'fc\.weight' is in the checkpoint and not in the library network"),
                         (renamed, r"'conv1\.weight' is missing from the checkpoint")):
        checkpoint = write_checkpoint(config, model, step=len(message))
        torch.save(bad, checkpoint / "model.pt")
        with pytest.raises(ValueError, match=r"does not match torchvision's resnet10 .*: " + message):
            export_checkpoint(config, checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_entry_without_an_export_mapping_is_refused_naming_it(tmp_path):
    entry = Backbone(name="resnet10_unexported", family="resnet", build=lambda s: build_resnet("resnet10", s),
                     options=frozenset({"small_input_stem"}), check=get_backbone("resnet10").check,
                     blocks=resnet_blocks)
    registry.register_backbone(entry)
    try:
        _, config = write_job(tmp_path / "run", {"arch": "resnet10_unexported"})
        checkpoint = write_checkpoint(config, trained_like(config))
        with pytest.raises(ValueError, match=r"model\.arch='resnet10_unexported' \(resnet\) has no export mapping"):
            export_checkpoint(config, checkpoint, tmp_path / "out")
    finally:
        del registry._BACKBONES[entry.name]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("head", ["mlp", "linear"])
def test_with_head_writes_a_head_that_loads_strictly_into_the_head_module(head, tmp_path):
    _, config = write_job(tmp_path / "run", {**RESNET10, "head": head})
    model = trained_like(config)
    out = export_checkpoint(config, write_checkpoint(config, model), tmp_path / "out", with_head=True)
    weights = load_file(out / "head.safetensors")
    assert set(weights) == set(model.head.state_dict())
    fresh = trained_like(config, seed=1).head
    fresh.load_state_dict(weights, strict=True)
    for key, value in model.head.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0)
    described = json.loads((out / "config.json").read_text())["instcls"]["head"]
    assert described["kind"] == head and described["in_features"] == 512 and described["out_features"] == 8
    # the card's own head code builds a module the file loads into (strict), with the same numbers
    card = (out / "README.md").read_text()
    head_code = card.split("The projection head, after the snippet above:\n\n```python\n", 1)[1].split("```")[0]
    namespace = {"torch": torch, "load_file": lambda name: load_file(out / name)}
    exec(head_code, namespace)
    features = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(namespace["head"](features), model.head(features), rtol=0, atol=0)


def test_the_command_line_exports_auto_and_answers_exit_code_2_with_one_line(run, tmp_path, capsys):
    path, _, _, checkpoint = run
    out = tmp_path / "out"
    assert main(["export", "--config", str(path), "--checkpoint", "auto", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"exported the backbone of {checkpoint} to {out}" in printed
    assert "network = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1])" in printed
    assert (out / "model.safetensors").is_file()
    assert main(["export", "--config", str(path), "--checkpoint", "auto", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "is not empty" in error and "--force" in error
    assert main(["export", "--config", str(path), "--set", "model.small_input_stem=false", "--checkpoint",
                 str(checkpoint), "--out", str(tmp_path / "other")]) == 2
    assert "model.small_input_stem is True there and False here" in capsys.readouterr().err
    assert main(["export", "--config", str(path), "--checkpoint", str(tmp_path), "--out", str(out), "--force"]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err
