"""``model.init_from``: a backbone started from a plain torchvision or timm state dict, an export's
safetensors or another run's model.pt holds that file's tensors, drops the file's classifier
(listed), and refuses another architecture naming the key, a missing file and an unreadable one."""

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from tests.helpers.training import REPO
from trainer.checkpoint.initial_weights import load_initial_weights, starting_network
from trainer.config import ConfigError, load_job_config
from trainer.models import ModelConfig, build_model

DEMO = REPO / "configs" / "demo_cpu.yaml"


def _job(tmp_path, init_from, arch="resnet18", extra=()):
    return load_job_config(DEMO, [f"data.train_shards={tmp_path}", f"model.arch={arch}",
                                  "model.small_input_stem=false", f"model.init_from={init_from}", *extra])


def test_a_run_from_a_plain_torchvision_file_holds_every_backbone_tensor_of_it(tmp_path):
    """An unmodified ``torchvision.models.resnet18()`` state dict: every tensor but ``fc`` is in the
    starting network's backbone, bit for bit, and the random init it replaced is gone; the dropped
    classifier keys are said."""
    torch.manual_seed(123)
    plain = torchvision.models.resnet18().state_dict()
    for key, value in plain.items():  # non-trivial BatchNorm statistics too
        if key.endswith(("running_mean", "running_var")):
            value.uniform_(0.5, 1.5)
    torch.save(plain, tmp_path / "resnet18.pth")
    said = []
    model = starting_network(_job(tmp_path, tmp_path / "resnet18.pth"), said.append)
    loaded = model.backbone.state_dict()
    assert set(loaded) == set(plain) - {"fc.weight", "fc.bias"}
    for key, value in loaded.items():
        assert torch.equal(value, plain[key]), key
    assert said == [f"model.init_from: {len(plain) - 2} backbone tensors from {tmp_path / 'resnet18.pth'}"
                    "; layout: plain state dict (instcls export, torchvision or timm): no prefix stripped"
                    "; classifier keys dropped (2): fc.bias, fc.weight"], said
    random_init = starting_network(load_job_config(DEMO, [f"data.train_shards={tmp_path}", "model.arch=resnet18",
                                                          "model.small_input_stem=false"]))
    assert not torch.equal(random_init.backbone.conv1.weight, model.backbone.conv1.weight)


@pytest.mark.parametrize("form", ["safetensors", "wrapped", "checkpoint_folder"])
def test_the_other_forms_of_a_backbone_file_load_the_same_tensors(tmp_path, form):
    """An export-like ``.safetensors``, a ``{"state_dict": {"module.*": ...}}`` training file, and an
    instcls checkpoint folder's model.pt (``backbone.*`` and the projection ``head.*``)."""
    source = build_model(ModelConfig(arch="resnet10", small_input_stem=True, feature_dim=16, head_hidden_dim=32))
    trunk = {key: value.clone() for key, value in source.backbone.state_dict().items()}
    if form == "safetensors":
        path = tmp_path / "model.safetensors"
        save_file({k: v.contiguous() for k, v in trunk.items()}, str(path))
        dropped, rule = [], "plain state dict (instcls export, torchvision or timm): no prefix stripped"
    elif form == "wrapped":
        path = tmp_path / "trained.pth"
        torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in trunk.items()}}, path)
        dropped, rule = [], "plain state dict (instcls export, torchvision or timm): prefix 'module.' stripped"
    else:
        rule = "instcls checkpoint model.pt: prefix 'backbone.' stripped"
        path = tmp_path / "step_000000010"
        path.mkdir()
        torch.save(source.state_dict(), path / "model.pt")
        dropped = sorted(k[len("backbone."):] if k.startswith("backbone.") else k for k in source.state_dict()
                         if k.startswith("head."))
    target = build_model(ModelConfig(arch="resnet10", small_input_stem=True))
    report = load_initial_weights(target.backbone, path)
    assert report.dropped == dropped and report.loaded == len(trunk) and report.rule == rule
    for key, value in target.backbone.state_dict().items():
        assert torch.equal(value, trunk[key]), key


def test_a_timm_file_drops_its_classifier_head(tmp_path):
    import timm

    network = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8)
    torch.save(network.state_dict(), tmp_path / "vit.pth")
    target = build_model(ModelConfig(arch="vit_tiny_patch16_224", img_size=32, patch_size=8, head="linear"))
    report = load_initial_weights(target.backbone, tmp_path / "vit.pth")
    assert report.dropped == ["head.bias", "head.weight"]
    assert torch.equal(target.backbone.pos_embed, network.pos_embed)


def test_another_architecture_is_refused_naming_the_first_key_whose_shape_differs(tmp_path):
    torch.save(torchvision.models.resnet50().state_dict(), tmp_path / "resnet50.pth")
    target = build_model(ModelConfig(arch="resnet18"))
    before = target.backbone.layer1[0].conv1.weight.clone()
    with pytest.raises(ValueError, match=r"is another architecture: layer1\.0\.conv1\.weight has shape "
                                         r"\(64, 64, 1, 1\) there and \(64, 64, 3, 3\)"):
        load_initial_weights(target.backbone, tmp_path / "resnet50.pth")
    assert torch.equal(before, target.backbone.layer1[0].conv1.weight), "nothing is half-loaded"


def test_strict_refuses_missing_and_unexpected_keys_and_lenient_loads_what_matches(tmp_path):
    """resnet34's extra blocks in a resnet18: strict names them; ``init_strict: false`` loads the
    common tensors and lists the rest."""
    resnet34 = torchvision.models.resnet34().state_dict()
    torch.save(resnet34, tmp_path / "resnet34.pth")
    target = build_model(ModelConfig(arch="resnet18"))
    with pytest.raises(ValueError, match=r"unexpected: layer1\.2\.bn1\.bias.*model\.init_strict: false"):
        load_initial_weights(target.backbone, tmp_path / "resnet34.pth")
    partial = {k: v for k, v in resnet34.items() if not k.startswith("layer4.")}
    torch.save(partial, tmp_path / "partial.pth")
    report = load_initial_weights(target.backbone, tmp_path / "partial.pth", strict=False)
    assert report.missing and all(key.startswith("layer4.") for key in report.missing)
    assert report.unexpected and all(key.startswith(("layer1.2", "layer2.2", "layer2.3", "layer3."))
                                     for key in report.unexpected)
    assert torch.equal(target.backbone.layer1[0].conv1.weight, resnet34["layer1.0.conv1.weight"])
    assert "missing, left at random init" in report.describe()


def test_a_missing_or_unreadable_file_is_refused_naming_the_field(tmp_path):
    target = build_model(ModelConfig(arch="resnet10"))
    with pytest.raises(FileNotFoundError, match=r"model.init_from=.*nothing.pth does not exist"):
        load_initial_weights(target.backbone, tmp_path / "nothing.pth")
    (tmp_path / "garbage.pth").write_bytes(b"not a state dict")
    with pytest.raises(ValueError, match=r"model.init_from=.*garbage.pth is unreadable"):
        load_initial_weights(target.backbone, tmp_path / "garbage.pth")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors .* nor model.pt"):
        load_initial_weights(target.backbone, tmp_path / "empty")


def test_init_strict_takes_only_a_boolean(tmp_path):
    with pytest.raises(ConfigError, match="model.init_strict"):
        load_job_config(DEMO, [f"data.train_shards={tmp_path}", "model.init_strict=sometimes"])


def test_a_resumed_run_does_not_read_init_from_and_says_so(tmp_path):
    """The checkpoint's weights win: the file is not even opened (here it is gone), the starting
    network is the seed's random init, and one line names both."""
    said = []
    resumed = tmp_path / "checkpoints" / "step_000000004"
    model = starting_network(_job(tmp_path, tmp_path / "deleted.pth"), said.append, resumed)
    fresh = starting_network(load_job_config(DEMO, [f"data.train_shards={tmp_path}", "model.arch=resnet18",
                                                    "model.small_input_stem=false"]))
    assert torch.equal(model.backbone.conv1.weight, fresh.backbone.conv1.weight)
    assert said == [f"model.init_from={tmp_path / 'deleted.pth'} is ignored: the run resumes from {resumed}, "
                    "whose weights win"], said
