"""The backbone's GPU speed-ups, checked for agreement with the plain path on CPU: channels_last
(NHWC weights and input) and the compiled network give the same features and gradients, and
``cudnn.benchmark`` is on unless the run is deterministic."""

import pytest
import torch

from trainer.models import ModelConfig, build_model
from trainer.models.backbone import model_input
from trainer.parallel.determinism import apply_determinism

TINY = dict(arch="resnet10", small_input_stem=True, head_hidden_dim=32, feature_dim=8)


def _features_and_gradients(config: ModelConfig, images: torch.Tensor, compile: bool = False):
    """In float64: a ReLU or BatchNorm input within float32 rounding of a tie would flip with the
    summation order and move a gradient by percents, which is not what the test is after."""
    torch.manual_seed(0)
    model = build_model(config).double()
    if compile:
        model.compile()
    features = model(model_input(images, torch.float64, config))
    (features.square().sum()).backward()
    return features.detach(), {name: p.grad for name, p in model.named_parameters()}, model


def _assert_gradients_agree(mine: dict, reference: dict) -> None:
    """Within float64 summation-order rounding of each tensor's scale and the network's (a bias
    behind BatchNorm has a gradient of ~0: rounding noise, which a relative tolerance would compare
    with rounding noise)."""
    assert mine.keys() == reference.keys()
    network = max(grad.abs().max() for grad in reference.values())
    for name, grad in reference.items():
        assert (mine[name] - grad).abs().max() <= 1e-9 * grad.abs().max() + 1e-12 * network, name


def test_channels_last_gives_the_plain_layouts_features_and_gradients():
    images = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    plain, plain_grads, _ = _features_and_gradients(ModelConfig(**TINY), images)
    layouts = []
    torch.nn.modules.module.register_module_forward_hook(
        lambda module, inputs, output: layouts.append(output.is_contiguous(memory_format=torch.channels_last))
        if isinstance(module, torch.nn.Conv2d) else None)
    try:
        nhwc, nhwc_grads, model = _features_and_gradients(ModelConfig(**TINY, channels_last=True), images)
    finally:
        torch.nn.modules.module._global_forward_hooks.clear()
    assert layouts and all(layouts), layouts  # every convolution ran NHWC, fed by the NHWC batch
    assert model.backbone.conv1.weight.is_contiguous()  # as DeepSpeed's broadcast and ZeRO partitions need
    assert model_input(images, torch.bfloat16, ModelConfig(**TINY, channels_last=True)).is_contiguous(
        memory_format=torch.channels_last)
    torch.testing.assert_close(nhwc, plain, rtol=1e-9, atol=1e-12)
    _assert_gradients_agree(nhwc_grads, plain_grads)
    # the names a checkpoint holds do not depend on the layout
    assert set(build_model(ModelConfig(**TINY, channels_last=True)).state_dict()) == \
        set(build_model(ModelConfig(**TINY)).state_dict())


@pytest.mark.slow  # inductor compiles a ResNet's forward and backward: about a minute on 2 cores
def test_the_compiled_network_gives_the_eager_features_and_gradients():
    images = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    eager, eager_grads, _ = _features_and_gradients(ModelConfig(**TINY), images)
    compiled, compiled_grads, model = _features_and_gradients(ModelConfig(**TINY, compile=True), images, compile=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-9, atol=1e-12)
    _assert_gradients_agree(compiled_grads, eager_grads)
    assert set(model.state_dict()) == set(build_model(ModelConfig(**TINY)).state_dict())  # no "_orig_mod."


def test_cudnn_autotunes_unless_the_run_is_deterministic(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    apply_determinism(False)
    assert torch.backends.cudnn.benchmark is True
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    apply_determinism(True)
    assert torch.backends.cudnn.benchmark is False
