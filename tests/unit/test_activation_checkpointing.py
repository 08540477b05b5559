"""``model.activation_checkpointing``: every residual unit the registry lists is recomputed in the
backward instead of keeping its inside.  The gradients and the BatchNorm running statistics equal
the plain network's, autograd saves far fewer bytes, state dicts load across the setting, and the
memory profile still measures the plain network."""

import pytest
import torch
from torch import nn

import trainer.models.activation_checkpointing as activation_checkpointing
from trainer.models import ModelConfig, build_model
from trainer.models.activation_checkpointing import CheckpointedUnit, checkpoint_units
from trainer.models.backbones import get_backbone
from trainer.models.profile import model_profile

RESNET = dict(arch="resnet10", small_input_stem=True, head_hidden_dim=32, feature_dim=8)
VIT_TI = dict(arch="vit_tiny_patch16_224", patch_size=8, img_size=32, head_hidden_dim=32, feature_dim=8)
NETWORKS = {"resnet10": (RESNET, 16), "vit_tiny": (VIT_TI, 32)}


def _model(settings: dict, checkpointing: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(**settings, activation_checkpointing=checkpointing)).train()


def _images(side: int, step: int = 0) -> torch.Tensor:
    return torch.randn(4, 3, side, side, generator=torch.Generator().manual_seed(100 + step))


def _train(model: nn.Module, side: int, steps: int) -> dict[str, torch.Tensor]:
    """``steps`` SGD steps; the gradients of the last one by parameter name."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        model(_images(side, step)).square().sum().backward()
        gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
    return gradients


def _saved_bytes(model: nn.Module, side: int) -> int:
    """Bytes autograd keeps for the backward of one training forward, weights left out."""
    weights = {p.data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        if tensor.data_ptr() not in weights:
            saved[tensor.data_ptr()] = max(saved.get(tensor.data_ptr(), 0), tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(_images(side))
    del output
    return sum(saved.values())


@pytest.mark.parametrize("network", NETWORKS)
def test_every_listed_unit_is_checkpointed_and_the_gradients_equal_the_plain_networks(network):
    settings, side = NETWORKS[network]
    plain, checkpointed = _model(settings, False), _model(settings, True)
    units = get_backbone(settings["arch"]).blocks(checkpointed.backbone)
    assert units and all(isinstance(unit, CheckpointedUnit) for unit in units)
    assert not any(isinstance(module, CheckpointedUnit) for module in plain.modules())
    expected, got = _train(plain, side, 1), _train(checkpointed, side, 1)
    for name, gradient in expected.items():
        assert gradient.abs().sum() > 0, name
        torch.testing.assert_close(got[name], gradient, rtol=0, atol=1e-6, msg=name)


def test_the_recomputation_leaves_batch_norm_running_statistics_as_the_plain_network_has_them():
    """Two steps of a ResNet: each BatchNorm counts two batches and its running statistics are the
    plain network's, not moved a second time by the backward's recomputation."""
    plain, checkpointed = _model(RESNET, False), _model(RESNET, True)
    _train(plain, 16, 2)
    _train(checkpointed, 16, 2)
    expected, got = plain.state_dict(), checkpointed.state_dict()
    statistics = [name for name in expected if "running_" in name or "num_batches_tracked" in name]
    assert len(statistics) > 20
    for name in statistics:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert got["backbone.layer1.0.bn1.num_batches_tracked"] == 2


@pytest.mark.slow  # inductor compiles resnet10's forward and backward with the checkpoints: about a minute on 2 cores
def test_the_compiled_checkpointed_network_updates_running_statistics_once_with_the_eager_gradients():
    """Compiled, the recomputation is the partitioner's (dynamo takes no context_fn): the buffer
    updates still happen once per forward.  Inductor's kernels round otherwise than eager ones
    (about 2e-4 of a tensor's largest value here); a second update would move the running means
    by a tenth of the batch statistics and count four batches."""
    plain, compiled = _model(RESNET, False), _model(RESNET, True)
    compiled.compile()
    expected, got = _train(plain, 16, 2), _train(compiled, 16, 2)
    for found, reference in ((got, expected), (compiled.state_dict(), plain.state_dict())):
        for name, value in found.items():
            scale = max(1.0, reference[name].double().abs().max())
            assert (value.double() - reference[name].double()).abs().max() <= 1e-3 * scale, name
    assert compiled.state_dict()["backbone.layer1.0.bn1.num_batches_tracked"] == 2


@pytest.mark.parametrize("network", NETWORKS)
def test_autograd_keeps_far_fewer_bytes_with_checkpointing(network):
    """What stays saved is what lies outside the units and the units' inputs (the profile's figures
    for them, per image); the units' insides are gone until their recomputation.  A ResNet's stem
    at full resolution is a large share of resnet10's total, a ViT's is tiny."""
    settings, side = NETWORKS[network]
    plain, checkpointed = _saved_bytes(_model(settings, False), side), _saved_bytes(_model(settings, True), side)
    assert checkpointed < plain / {"resnet10": 2, "vit_tiny": 10}[network], (plain, checkpointed)
    profile = model_profile(ModelConfig(**settings), side)
    images = _images(side).shape[0]
    assert images * profile.outside_block_bytes < checkpointed
    assert checkpointed <= images * (profile.outside_block_bytes + profile.block_input_bytes)


def test_checkpointing_runs_only_in_training_forwards_that_record_a_graph(monkeypatch):
    calls = []

    def counting(function, *args, **kwargs):
        calls.append(function)
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(activation_checkpointing, "checkpoint", counting)
    model = _model(RESNET, True)
    model(_images(16))
    assert len(calls) == 4  # resnet10: one block per stage
    with torch.no_grad():
        model(_images(16))
    model.eval()
    model(_images(16))
    assert len(calls) == 4


def test_a_state_dict_saved_without_checkpointing_loads_with_it_and_gives_the_same_outputs():
    plain = _model(RESNET, False, seed=0)
    _train(plain, 16, 1)  # running statistics and weights away from their init
    checkpointed = _model(RESNET, True, seed=1)
    state = plain.state_dict()
    assert list(checkpointed.state_dict()) == list(state)
    checkpointed.load_state_dict(state)
    for model in (plain, checkpointed):
        model.eval()
    torch.testing.assert_close(checkpointed(_images(16)), plain(_images(16)), rtol=0, atol=0)
    plain.load_state_dict(checkpointed.state_dict())  # and back


def test_the_memory_profile_measures_the_plain_network_whatever_the_setting():
    plain = model_profile(ModelConfig(**VIT_TI), 32)
    assert model_profile(ModelConfig(**VIT_TI, activation_checkpointing=True), 32) == plain


def test_a_unit_holding_its_own_parameters_is_refused_and_the_setting_must_be_a_bool():
    with pytest.raises(ValueError, match=r"Linear holds parameters \['weight', 'bias'\] itself"):
        checkpoint_units([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"activation_checkpointing='yes' is invalid: use true"):
        ModelConfig(**RESNET, activation_checkpointing="yes")
