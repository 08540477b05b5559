"""The backbone registry: every entry builds on the meta device with the parameter count its papers
publish (and, exactly, the count its architecture's formula gives), a config naming no entry or
setting another family's field is refused naming the field, and ViTs come from timm without any
download while ResNet jobs never import timm."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers.parameter_counts import basic_block_resnet_parameters, vit_trunk_parameters
from tests.helpers.training import REPO
from trainer.config_building import ConfigError
from trainer.models import ModelConfig, backbone_names
from trainer.models.backbones import get_backbone

# Published parameter counts with the 1000-way ImageNet classification layer (ResNet paper and
# torchvision; ViT-Ti/S from DeiT, ViT-B/L/H from the ViT paper and timm).  ResNet-10 has none.
PUBLISHED = {"resnet18": 11.7e6, "resnet34": 21.8e6, "resnet50": 25.6e6, "resnet101": 44.5e6,
             "vit_tiny_patch16_224": 5.7e6, "vit_small_patch16_224": 22e6, "vit_base_patch16_224": 86e6,
             "vit_large_patch16_224": 304e6, "vit_huge_patch14_224": 632e6}
# (width, depth, patch, image side) of each ViT, from the ViT and DeiT papers.
VIT_SHAPES = {"vit_tiny_patch16_224": (192, 12, 16, 224), "vit_small_patch16_224": (384, 12, 16, 224),
              "vit_base_patch16_224": (768, 12, 16, 224), "vit_large_patch16_224": (1024, 24, 16, 224),
              "vit_huge_patch14_224": (1280, 32, 14, 224)}


def _meta_trunk(name: str, **settings):
    with torch.device("meta"):
        trunk = get_backbone(name).build(ModelConfig(arch=name, **settings))
    parameters = list(trunk.module.parameters())
    assert parameters and all(p.is_meta for p in parameters)  # nothing allocated, nothing initialised for real
    return trunk, sum(p.numel() for p in parameters)


def test_instcls_plan_offers_every_entry_and_plans_a_vit_at_its_configs_patch_size(tmp_path):
    from trainer.cli import build_parser, main

    assert set(PUBLISHED) | {"resnet10"} == set(backbone_names())
    subcommands = next(a for a in build_parser()._actions if a.dest == "command").choices
    backbone = next(a for a in subcommands["plan"]._actions if a.dest == "backbone")
    assert backbone.choices == [*backbone_names(), "none"]
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", str(REPO / "configs/vit_tiny_cpu.yaml"), "--ranks", "2", "--num-classes", "1438",
                 "--json", str(out)]) == 0
    head = 192 * 512 + 512 + 2 * 512 + 512 * 128 + 128  # linear, BatchNorm, linear of the MLP head
    weights = json.loads(out.read_text())["dhp"]["breakdown"]["backbone weights"]
    assert weights == (vit_trunk_parameters(192, 12, 8, 32) + head) * 4  # fp32 (ZeRO-0): patch 8, 4 x 4 grid


@pytest.mark.parametrize("name", backbone_names())
def test_every_entry_builds_on_the_meta_device_with_its_published_parameter_count(name):
    trunk, parameters = _meta_trunk(name)
    if name in VIT_SHAPES:
        assert parameters == vit_trunk_parameters(*VIT_SHAPES[name])
        assert trunk.width == VIT_SHAPES[name][0]
    elif name in ("resnet10", "resnet18", "resnet34"):
        assert parameters == basic_block_resnet_parameters({"resnet10": [1, 1, 1, 1], "resnet18": [2, 2, 2, 2],
                                                            "resnet34": [3, 4, 6, 3]}[name])
        assert trunk.width == 512
    else:
        assert trunk.width == 2048
    if name in PUBLISHED:  # with the classification layer the published counts include
        assert parameters + (trunk.width + 1) * 1000 == pytest.approx(PUBLISHED[name], rel=0.02)


def test_a_vit_takes_the_configs_patch_and_image_size():
    trunk, parameters = _meta_trunk("vit_tiny_patch16_224", patch_size=4, img_size=32)
    assert parameters == vit_trunk_parameters(192, 12, 4, 32)
    assert tuple(trunk.module.pos_embed.shape) == (1, 8 * 8 + 1, 192)


def _load(tmp_path, model: str):
    from trainer.config import load_job_config

    path = tmp_path / "job.yaml"
    path.write_text(f"data: {{train_shards: x}}\nmodel: {model}\n")
    return load_job_config(path)


def test_an_unknown_arch_is_refused_naming_the_field_and_every_choice(tmp_path):
    with pytest.raises(ConfigError, match=r": model.arch='vit_giant_patch16_224' is invalid: choose one of") as raised:
        _load(tmp_path, "{arch: vit_giant_patch16_224}")
    assert all(name in str(raised.value) for name in backbone_names())


@pytest.mark.parametrize("model,message", [
    ("{arch: resnet50, patch_size: 4}",
     r"model.patch_size=4 is invalid for resnet50 \(resnet\): only vit backbones read it; remove it"),
    ("{arch: resnet18, img_size: 32}", r"model.img_size=32 is invalid for resnet18 \(resnet\): only vit backbones"),
    ("{arch: vit_tiny_patch16_224, small_input_stem: true}",
     r"model.small_input_stem=True is invalid for vit_tiny_patch16_224 \(vit\): only resnet backbones read it"),
    ("{arch: vit_tiny_patch16_224, img_size: 30, patch_size: 4}",
     r"model.patch_size=4 is invalid for img_size=30: the image side must be a multiple of the patch size"),
    ("{arch: vit_small_patch16_224, patch_size: 0}", r"model.patch_size=0 is invalid: use a positive number"),
    ("{arch: resnet50, pool: avg}", r"model.pool='avg' is invalid for resnet50 \(resnet\): only vit backbones read it"),
    ("{arch: vit_tiny_patch16_224, pool: max}", r"model.pool='max' is invalid: use token \(the class token"),
    ("{arch: resnet10, input_norm: per_channel}", r"model.input_norm='per_channel' is invalid: use none or per_image"),
])
def test_a_field_of_another_family_or_a_size_the_family_cannot_build_is_refused(tmp_path, model, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, model)


def test_the_shipped_vit_configs_load(tmp_path):
    from trainer.config import load_job_config

    tiny = load_job_config(REPO / "configs/vit_tiny_cpu.yaml")
    assert (tiny.model.arch, tiny.model.patch_size, tiny.model.img_size) == ("vit_tiny_patch16_224", 8, 32)
    assert (tiny.model.pool, tiny.model.input_norm, tiny.optim.name) == ("avg", "per_image", "adamw")
    base = load_job_config(REPO / "configs/in21k_vitb16_64gpu.yaml")
    assert base.model.arch == "vit_base_patch16_224" and base.data.loader.augment.image_size == 224


OFFLINE_BUILD = textwrap.dedent("""
    import json, os, socket, sys

    def refuse(*args, **kwargs):
        raise OSError("network access during a model build")

    socket.socket.connect = socket.socket.connect_ex = refuse
    socket.create_connection = socket.getaddrinfo = refuse
    import trainer
    from trainer.models import ModelConfig, build_model

    build_model(ModelConfig(arch="resnet10"))
    after_resnet = "timm" in sys.modules
    model = build_model(ModelConfig(arch="vit_tiny_patch16_224", patch_size=4, img_size=32))
    written = [os.path.join(d, f) for root in (os.environ["HF_HOME"], os.environ["TORCH_HOME"])
               for d, _, files in os.walk(root) for f in files]
    print(json.dumps({"timm_after_resnet": after_resnet, "timm_after_vit": "timm" in sys.modules,
                      "random_init": float(model.backbone.cls_token.abs().max()) < 1e-4,
                      "written": written}))
""")


@pytest.mark.integration
def test_resnets_never_import_timm_and_a_vit_is_built_offline_from_nothing_downloaded(tmp_path):
    """In a fresh interpreter every socket refuses to connect and the hub caches are empty folders:
    the ViT still builds, at random init (timm draws the class token at std 1e-6; trained weights
    are far larger), and nothing lands in the caches.  Before it, a ResNet job has not imported timm."""
    env = {"HF_HOME": str(tmp_path / "hf"), "TORCH_HOME": str(tmp_path / "torch"), "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1"}
    for folder in ("hf", "torch"):
        (tmp_path / folder).mkdir()
    done = subprocess.run([sys.executable, "-c", OFFLINE_BUILD], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"timm_after_resnet": False, "timm_after_vit": True, "random_init": True, "written": []}


def test_the_training_docs_name_every_backbone():
    text = (REPO / "docs/training.md").read_text()
    assert [name for name in backbone_names() if f"`{name}`" not in text] == []
