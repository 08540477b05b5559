"""``model.init_from`` reads the checkpoints that self-supervised methods' own code writes: MoCo v2's,
DINO's full checkpoint and a BYOL learner's of lucidrains/byol-pytorch.

The files are built here from an instcls ResNet's own state dicts under each layout's prefixes
(nothing is downloaded), with a second, differently seeded network as the other one of the
method's two, so that a test can tell which was read.  Each run must start from exactly the
chosen network's tensors, and its log line must name the layout, the prefix stripped and the keys
dropped.  A file whose keys fit no layout is refused naming the file and the layouts known.
"""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from tests.helpers.training import REPO
from trainer.checkpoint.initial_weights import load_initial_weights, starting_network
from trainer.config import ConfigError, load_job_config
from trainer.models import ModelConfig, build_model

DEMO = REPO / "configs" / "demo_cpu.yaml"  # resnet10 with the ImageNet stem


def _trunk(seed: int) -> dict[str, torch.Tensor]:
    """A resnet10 trunk's state dict at the seed's random init, with non-trivial BatchNorm statistics."""
    torch.manual_seed(seed)
    state = build_model(ModelConfig(arch="resnet10")).backbone.state_dict()
    for key, value in state.items():
        if key.endswith(("running_mean", "running_var")):
            value.uniform_(0.5, 1.5)
        elif key.endswith("num_batches_tracked"):
            value.fill_(seed)
    return {key: value.clone() for key, value in state.items()}


@pytest.fixture(scope="module")
def networks() -> dict[str, dict[str, torch.Tensor]]:
    return {"student": _trunk(1), "teacher": _trunk(2)}


def _under(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + key: value for key, value in state.items()}


def _moco_v2(networks):
    """main_moco.py's save: the query and key encoders (torchvision ResNets whose ``fc`` is MoCo v2's
    MLP, Linear-ReLU-Linear) and the queue, inside DDP's ``module.``."""
    def encoder(name, trunk):
        mlp = {"fc.0.weight": torch.randn(512, 512), "fc.0.bias": torch.randn(512),
               "fc.2.weight": torch.randn(128, 512), "fc.2.bias": torch.randn(128)}
        return _under(f"module.{name}.", {**trunk, **mlp})

    state = {**encoder("encoder_q", networks["student"]), **encoder("encoder_k", networks["teacher"]),
             "module.queue": torch.randn(128, 256), "module.queue_ptr": torch.zeros(1, dtype=torch.long)}
    return {"epoch": 200, "arch": "resnet50", "state_dict": state,
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.03, "momentum": 0.9, "params": [0, 1]}]}}


def _dino(networks):
    """main_dino.py's checkpoint.pth: two MultiCropWrapper state dicts (the student under DDP's
    ``module.``, the teacher without it, as for a ViT), the optimizer, the loss's centre and the
    command line as an argparse.Namespace."""
    def wrapper(prefix, trunk):
        head = {"head.mlp.0.weight": torch.randn(64, 512), "head.last_layer.weight_g": torch.ones(1, 32)}
        return _under(prefix, {**_under("backbone.", trunk), **head})

    return {"student": wrapper("module.", networks["student"]), "teacher": wrapper("", networks["teacher"]),
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.0005, "params": [0]}]}, "epoch": 100,
            "args": argparse.Namespace(arch="resnet10", out_dim=32, momentum_teacher=0.996, output_dir="."),
            "dino_loss": {"center": torch.zeros(1, 32)}}


def _byol(networks):
    """A ``byol_pytorch.BYOL`` learner's state_dict(): the wrapped torchvision network (its ``fc``
    kept: BYOL taps the layer before it) under ``net.`` and ``online_encoder.net.``, the projector,
    the predictor, and the momentum copy under ``target_encoder.``."""
    def wrapped(trunk):
        return {**trunk, "fc.weight": torch.randn(1000, 512), "fc.bias": torch.randn(1000)}

    def projector(prefix):
        return _under(prefix, {"projector.0.weight": torch.randn(256, 512),
                               "projector.1.running_mean": torch.zeros(256)})

    online = wrapped(networks["student"])
    return {**_under("net.", online), **_under("online_encoder.net.", online), **projector("online_encoder."),
            "online_predictor.0.weight": torch.randn(256, 256),
            **_under("target_encoder.net.", wrapped(networks["teacher"])), **projector("target_encoder.")}


N = len(_trunk(0))  # the resnet10 trunk's tensors
CASES = {  # layout, part -> (writer, network read, rule logged, other keys dropped, classifier keys dropped)
    "moco_v2": (_moco_v2, None, "student",
                "MoCo v2 checkpoint (facebookresearch/moco main_moco.py): the student (the default), "
                "prefix 'module.encoder_q.' stripped",
                {"module.encoder_k": N + 4, "module.queue": 1, "module.queue_ptr": 1},
                ["fc.0.bias", "fc.0.weight", "fc.2.bias", "fc.2.weight"]),
    "moco_v2_key_encoder": (_moco_v2, "teacher", "teacher",
                            "MoCo v2 checkpoint (facebookresearch/moco main_moco.py): the teacher "
                            "(model.init_from_part), prefix 'module.encoder_k.' stripped",
                            {"module.encoder_q": N + 4, "module.queue": 1, "module.queue_ptr": 1},
                            ["fc.0.bias", "fc.0.weight", "fc.2.bias", "fc.2.weight"]),
    "dino": (_dino, None, "teacher",
             "DINO full checkpoint (facebookresearch/dino main_dino.py): the teacher (the default), entry "
             "'teacher', prefix 'backbone.' stripped", {"head": 2}, []),
    "dino_student": (_dino, "student", "student",
                     "DINO full checkpoint (facebookresearch/dino main_dino.py): the student "
                     "(model.init_from_part), entry 'student', prefix 'module.backbone.' stripped",
                     {"module.head": 2}, []),
    "byol": (_byol, None, "student",
             "BYOL learner state dict (lucidrains/byol-pytorch): the student (the default), prefix "
             "'online_encoder.net.' stripped",
             {"net": N + 2, "online_encoder.projector": 2, "online_predictor": 1, "target_encoder": N + 4},
             ["fc.bias", "fc.weight"]),
    "byol_target": (_byol, "teacher", "teacher",
                    "BYOL learner state dict (lucidrains/byol-pytorch): the teacher (model.init_from_part), prefix "
                    "'target_encoder.net.' stripped",
                    {"net": N + 2, "online_encoder": N + 4, "online_predictor": 1, "target_encoder.projector": 2},
                    ["fc.bias", "fc.weight"]),
}


def _job(tmp_path, path, part=None):
    extra = [] if part is None else [f"model.init_from_part={part}"]
    return load_job_config(DEMO, [f"data.train_shards={tmp_path}", f"model.init_from={path}", *extra])


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_layout_starts_the_run_from_the_chosen_networks_tensors_and_logs_its_rule(tmp_path, networks, case):
    """Every backbone tensor equals the chosen network's source tensor bit for bit (not the other
    network's, not the random init), and the one log line names the layout, the prefix stripped, the
    kept count and each dropped group with its count."""
    write, part, source, rule, set_aside, classifier = CASES[case]
    path = tmp_path / f"{case}.pth"
    torch.save(write(networks), path)
    said = []
    model = starting_network(_job(tmp_path, path, part), said.append)
    loaded = model.backbone.state_dict()
    assert set(loaded) == set(networks[source])
    for key, value in loaded.items():
        assert torch.equal(value, networks[source][key]), key
    groups = ", ".join(f"{group} ({count})" for group, count in sorted(set_aside.items()))
    expected = (f"model.init_from: {N} backbone tensors from {path}; layout: {rule}; "
                f"other keys dropped ({sum(set_aside.values())}): {groups}")
    if classifier:
        expected += f"; classifier keys dropped ({len(classifier)}): {', '.join(classifier)}"
    assert said == [expected], said


@pytest.mark.parametrize("strict", [True, False])
def test_a_file_whose_keys_fit_no_layout_is_refused_naming_it_and_the_known_layouts(tmp_path, networks, strict):
    """A trunk under a prefix no rule knows (``encoder.``, as some SimCLR ports save it) loads
    nothing under any layout: refused even with init_strict false, and the backbone is untouched."""
    path = tmp_path / "simclr.pth"
    torch.save({"state_dict": _under("encoder.", networks["student"])}, path)
    target = build_model(ModelConfig(arch="resnet10"))
    before = target.backbone.conv1.weight.clone()
    unknown = re.escape(f"model.init_from={path} is a layout init_from does not know")
    with pytest.raises(ValueError, match=unknown) as refused:
        load_initial_weights(target.backbone, path, strict=strict)
    message = str(refused.value)
    for layout in ("plain state dict", "instcls checkpoint model.pt", "MoCo v2", "DINO full checkpoint", "BYOL",
                   "encoder.bn1.bias"):
        assert layout in message, message
    assert torch.equal(before, target.backbone.conv1.weight)


def test_a_part_is_refused_for_a_file_with_one_network_or_without_that_network(tmp_path, networks):
    plain = tmp_path / "plain.pth"
    torch.save(networks["student"], plain)
    target = build_model(ModelConfig(arch="resnet10"))
    with pytest.raises(ValueError, match=r"model\.init_from_part=teacher .* plain state dict .* remove "
                                         r"model\.init_from_part"):
        load_initial_weights(target.backbone, plain, part="teacher")
    teacher_only = tmp_path / "dino_teacher.pth"
    torch.save({"teacher": _under("backbone.", networks["teacher"])}, teacher_only)
    with pytest.raises(ValueError, match=r"DINO full checkpoint .* without a 'student' entry .* "
                                         r"set model\.init_from_part=teacher"):
        load_initial_weights(target.backbone, teacher_only, part="student")
    byol_without_target = tmp_path / "byol_no_momentum.pth"
    torch.save({key: value for key, value in _byol(networks).items() if not key.startswith("target_encoder.")},
               byol_without_target)
    with pytest.raises(ValueError, match=r"without the teacher's keys .* set model\.init_from_part=student"):
        load_initial_weights(target.backbone, byol_without_target, part="teacher")


def test_init_from_part_needs_init_from(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.init_from_part=teacher .* set model\.init_from"):
        load_job_config(DEMO, [f"data.train_shards={tmp_path}", "model.init_from_part=teacher"])
