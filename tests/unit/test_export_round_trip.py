"""`instcls export` hands out a backbone that plain timm / torchvision rebuild and load with
``strict=True``: for every registry entry the export's names and shapes are the library network's
(large ones on the meta device), and for the small ones the model card's own snippet, run in a
process that never imports instcls, gives the features instcls's ``backbone_features`` gives, within
1e-5 in fp32 (timm's ``local-dir:`` loader too).  The card shows the run's data, scores and config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from data_pipeline.shardset.manifest import MANIFEST_NAME
from tests.helpers.checkpoints import SIDE, trained_like, write_checkpoint, write_job, write_shards_manifest
from tests.helpers.training import REPO
from trainer.export import export_checkpoint, export_config, library_network_of, library_state_dict
from trainer.models import backbone_names, build_model
from trainer.provenance import collect_provenance, file_sha256, write_provenance

pytestmark = pytest.mark.xdist_group("export-round-trip")  # one worker builds the exports and runs their snippets

# Entries exported and run for real, each with the settings that change a key or a shape.
ROUND_TRIP = {
    "resnet10": [{"small_input_stem": True}],
    "resnet18": [{"small_input_stem": True, "input_norm": "per_image"}, {}],  # the standard stem too
    "resnet34": [{"small_input_stem": True}],
    "resnet50": [{"small_input_stem": True}],
    "vit_tiny_patch16_224": [{"patch_size": 8, "img_size": SIDE, "pool": "avg", "input_norm": "per_image"},
                             {"patch_size": 4, "img_size": SIDE, "pool": "token"}],
    "vit_small_patch16_224": [{"patch_size": 8, "img_size": SIDE, "pool": "avg"}],
}
META_ONLY = ("resnet101", "vit_base_patch16_224", "vit_large_patch16_224", "vit_huge_patch14_224")  # too large to run
TIMM_HUB_CASE = ("vit_tiny_patch16_224", 0)  # also loaded by timm's own local-dir: loader
RUN_JSON_CASE = ("resnet10", 0)  # a checkpoint with run.json and a scored step
README_CASE = ("resnet10", 0)  # the demo's network: README's quickstart loads its export
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def card_snippet(export: Path) -> str:
    """The first fenced python block of the export's README.md: the snippet the card tells users to run."""
    return (export / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]


_RUNNER = """
import os, sys
import torch

cases, raw, normalised, timm_case, readme_case = sys.argv[1:6]
raw, normalised = torch.load(raw), torch.load(normalised)
for line in open(cases).read().splitlines():
    export, out = line.split("\\t")
    os.chdir(export)
    card = open("README.md").read()
    namespace = {"__name__": "card"}
    exec(card.split("```python\\n", 1)[1].split("```", 1)[0], namespace)
    torch.save(namespace["embed"](raw), out)
    assert "trainer" not in sys.modules and "data_pipeline" not in sys.modules, export

import timm

export, out = timm_case.split("\\t")
network = timm.create_model("local-dir:" + export, pretrained=True).eval()
with torch.no_grad():
    torch.save(network(torch.nn.functional.instance_norm(normalised)), out)
assert "trainer" not in sys.modules

folder, snippet, out = readme_case.split("\t")  # README's step 5, from a folder outside the checkout
os.chdir(folder)
namespace = {"__name__": "readme"}
exec(open(snippet).read(), namespace)
with torch.no_grad():
    torch.save(namespace["network"](normalised), out)
assert "trainer" not in sys.modules
"""


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    """Every ROUND_TRIP case exported, and every card's snippet run in ONE fresh process:
    ``{(name, index): (export folder, instcls features, snippet features)}``, plus the timm
    loader's features under ``"timm"``."""
    root = tmp_path_factory.mktemp("export")
    raw = torch.rand(2, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(0))
    normalised = (raw - MEAN) / STD  # what instcls's loaders hand the network
    torch.save(raw, root / "raw.pt")
    torch.save(normalised, root / "normalised.pt")
    shards = write_shards_manifest(root / "shards", images=100)
    results, lines = {}, []
    for name, cases in ROUND_TRIP.items():
        for index, settings in enumerate(cases):
            folder = root / f"{name}-{index}"
            _, config = write_job(folder, {"arch": name, **settings}, shards)
            model = trained_like(config, seed=index)
            checkpoint = write_checkpoint(config, model)
            if (name, index) == RUN_JSON_CASE:
                provenance = collect_provenance(config, folder / "job.yaml", ["seed=0"], 2, ["h0", "h1"], "run-token")
                write_provenance(checkpoint, provenance)
                (folder / "logs").mkdir()
                (folder / "logs/rank-00000.jsonl").write_text("\n".join(json.dumps(record) for record in [
                    {"event": "eval", "step": 8, "knn_trained": 0.1},
                    {"event": "eval", "step": 12, "knn_trained": 0.4567, "knn_random_init": 0.1922,
                     "linear_trained": 0.5905, "linear_random_init": 0.2423}]) + "\n")
            export = export_checkpoint(config, checkpoint, folder / "export")
            with torch.no_grad():
                expected = model.backbone_features(normalised)
            results[name, index] = [export, expected, root / f"{name}-{index}.pt"]
            lines.append(f"{export}\t{root / f'{name}-{index}.pt'}")
    (root / "cases.tsv").write_text("\n".join(lines))
    timm_export = results[TIMM_HUB_CASE][0]
    readme = root / "readme"  # the quickstart's paths, relative to a folder of the user's
    (readme / "out" / "photos").mkdir(parents=True)
    (readme / "out" / "photos" / "export").symlink_to(results[README_CASE][0])
    (root / "readme.py").write_text(readme_snippet())
    run = subprocess.run([sys.executable, "-c", _RUNNER, str(root / "cases.tsv"), str(root / "raw.pt"),
                          str(root / "normalised.pt"), f"{timm_export}\t{root / 'timm.pt'}",
                          f"{readme}\t{root / 'readme.py'}\t{root / 'readme.pt'}"], cwd=root,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr[-4000:]
    for key, (export, expected, out) in results.items():
        results[key] = (export, expected, torch.load(out))
    results["timm"] = torch.load(root / "timm.pt")
    results["readme"] = torch.load(root / "readme.pt")
    return results


def readme_snippet() -> str:
    """The Python block of README.md's quickstart step 5, "Use the backbone"."""
    section = (REPO / "README.md").read_text().split("**5. Use the backbone.**", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.integration  # the module's exports and one interpreter running their snippets: ~30 s
def test_the_readmes_use_the_backbone_step_loads_the_demos_export_from_another_folder(round_trips):
    """The quickstart's snippet, run as written from a folder outside the checkout (instcls never
    imported) on an export of the demo's network (ResNet-10, small stem), gives instcls's features."""
    torch.testing.assert_close(round_trips["readme"], round_trips[README_CASE][1], rtol=1e-5, atol=1e-5)


@pytest.mark.integration  # the module's exports and one interpreter running their snippets: ~30 s
@pytest.mark.parametrize("name", [name for name in backbone_names() if name not in META_ONLY])
def test_the_cards_snippet_gives_instcls_features_without_instcls(name, round_trips):
    assert name in ROUND_TRIP, f"add {name} to ROUND_TRIP (or, if it is too large to run here, to META_ONLY)"
    for index in range(len(ROUND_TRIP[name])):
        export, expected, features = round_trips[name, index]
        assert features.shape == expected.shape
        torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)
        with safe_open(export / "model.safetensors", "pt") as weights:
            assert weights.metadata() == {"format": "pt"}
            names = weights.keys()  # a safetensors file is not iterable: its keys() lists the tensors
            assert all(weights.get_tensor(key).dtype in (torch.float32, torch.int64) for key in names)
            assert not any(key.startswith(("backbone.", "head.", "fc.")) for key in names)


@pytest.mark.integration  # the module's exports and one interpreter running their snippets: ~30 s
def test_timm_loads_the_export_folder_by_itself(round_trips):
    """config.json is timm's hub layout: ``create_model("local-dir:...", pretrained=True)`` rebuilds the
    avg-pooled ViT at its patch and image size and loads the weights, offline."""
    export, expected, _ = round_trips[TIMM_HUB_CASE]
    torch.testing.assert_close(round_trips["timm"], expected, rtol=1e-5, atol=1e-5)
    exported = json.loads((export / "config.json").read_text())
    assert exported["model_args"] == {"num_classes": 0, "img_size": SIDE, "patch_size": 8, "global_pool": "avg",
                                      "dynamic_img_size": True}
    assert exported["pretrained_cfg"]["input_size"] == [3, SIDE, SIDE]
    assert "instance_norm" in card_snippet(export)  # the run standardised each image: so does the snippet
    assert "instance_norm" not in card_snippet(round_trips["vit_tiny_patch16_224", 1][0])


def _library_network_from_config(exported: dict) -> torch.nn.Module:
    """The network config.json describes, built with the library alone (not with the entry's code)."""
    if "model_args" in exported:
        import timm

        return timm.create_model(exported["architecture"], pretrained=False, **exported["model_args"])
    import torchvision

    arch = exported["architecture"]
    network = (torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1])
               if arch == "resnet10" else getattr(torchvision.models, arch)(weights=None))
    if exported["instcls"]["small_input_stem"]:
        network.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        network.maxpool = torch.nn.Identity()
    network.fc = torch.nn.Identity()
    return network


@pytest.mark.parametrize("name", backbone_names())
def test_every_entry_exports_the_library_networks_names_and_shapes(name, tmp_path):
    """On the meta device (no memory, so ViT-H too): the export mapping applied to instcls's state
    dict gives exactly the names and shapes of the network config.json describes, for each setting
    of the family that changes one (a ResNet's stem, a ViT's pooling and grid)."""
    family = name.split("_")[0].rstrip("0123456789")
    # every setting that changes a name or a shape off its default (a ViT's token pooling runs above)
    variants = {"resnet": [{}, {"small_input_stem": True}], "vit": [{"pool": "avg", "patch_size": 8, "img_size": 64}]}[
        family]
    for index, settings in enumerate(variants):
        _, config = write_job(tmp_path / str(index), {"arch": name, **settings})
        with torch.device("meta"):
            model = build_model(config.model)
            library = library_network_of(config.model)
            exported = export_config(config, library, model.backbone_width)
            reference = _library_network_from_config(exported).state_dict()
        weights = library_state_dict(model.state_dict(), library, name)
        assert list(weights) == list(reference)
        assert {key: tuple(t.shape) for key, t in weights.items()} == {key: tuple(t.shape)
                                                                        for key, t in reference.items()}
        assert exported["num_features"] == model.backbone_width
        if family == "vit" and settings.get("pool") == "avg":
            assert "fc_norm.weight" in weights and "norm.weight" not in weights  # timm's avg-pool layout


@pytest.mark.integration  # the module's exports and one interpreter running their snippets: ~30 s
def test_the_card_shows_the_runs_data_scores_provenance_and_config(round_trips):
    export = round_trips[RUN_JSON_CASE][0]
    card = (export / "README.md").read_text()
    run = json.loads((export / "run.json").read_text())  # copied from the checkpoint
    assert run["run"] == "run-token"
    assert f"manifest digest `{run['train_manifest']['digest']}`" in card and "100 images" in card
    assert "| kNN | 45.67% | 19.22% |" in card and "| linear probe | 59.05% | 24.23% |" in card  # step 12's record
    assert "global step 12" in card and "global batch 64" in card and "epoch 3" in card
    assert "```yaml\n" + run["config"].rstrip("\n") + "\n```" in card
    assert "started from: random init" in card and "--set seed=0" in card  # describe_provenance's lines
    assert "- `temperature`:" in card  # the objective's settings
    exported = json.loads((export / "config.json").read_text())
    assert exported["instcls"] | {"checkpoint": None} == {
        "arch": "resnet10", "library": "torchvision", "architecture": "resnet10", "small_input_stem": True,
        "img_size": None, "patch_size": None, "pool": None, "input_norm": "none", "width": 512,
        "input_size": [3, SIDE, SIDE], "resize": 37, "interpolation": "bilinear", "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225], "checkpoint": None}
    assert sorted(p.name for p in export.iterdir()) == ["README.md", "config.json", "model.safetensors", "run.json"]


def test_a_checkpoint_without_run_json_takes_the_data_from_the_manifest_and_says_not_scored(tmp_path):
    shards = write_shards_manifest(tmp_path / "shards", images=321)
    _, config = write_job(tmp_path / "job", {"arch": "resnet10", "small_input_stem": True}, shards)
    export = export_checkpoint(config, write_checkpoint(config, trained_like(config)), tmp_path / "out")
    card = (export / "README.md").read_text()
    assert f"321 images, manifest digest `{file_sha256(shards / MANIFEST_NAME)}`" in card
    assert "Not scored: the run's log has no evaluation at step 12." in card
    assert "has no `run.json`" in card and not (export / "run.json").exists()
