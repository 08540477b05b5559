"""BatchNorm under a bf16 DeepSpeed engine, which casts parameters to bf16 and leaves the running
statistics in fp32: the network still trains and evaluates, NCHW and NHWC alike (the first GPU run
found PyTorch's kernels refusing that mix in ``instcls selftest``'s bf16 ZeRO-2 step)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.models import ModelConfig, build_model
from trainer.models.batch_norm_precision import accept_low_precision_parameters


def _as_deepspeed_casts_it(model: nn.Module) -> nn.Module:
    """DeepSpeed 0.19's bf16 cast: parameters only, buffers stay fp32."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    return model


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_a_bf16_network_with_fp32_statistics_trains_in_either_layout(layout):
    torch.manual_seed(0)
    model = _as_deepspeed_casts_it(build_model(ModelConfig(arch="resnet10", small_input_stem=True)))
    images = torch.randn(4, 3, 16, 16).to(torch.bfloat16, memory_format=layout)
    model(images).float().square().mean().backward()
    batch_norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert batch_norms and all(m.running_mean.dtype == torch.float32 for m in batch_norms)
    assert all(m.weight.grad is not None and m.weight.grad.dtype == torch.bfloat16 for m in batch_norms)
    assert all(int(m.num_batches_tracked) == 1 for m in batch_norms)
    model.eval()
    assert torch.isfinite(model(images).float()).all()


@pytest.mark.parametrize("training", [True, False])
def test_the_layer_matches_a_float64_batch_norm(training):
    torch.manual_seed(1)
    reference = nn.BatchNorm2d(6).double()
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
        reference.running_mean.uniform_(-1, 1)
        reference.running_var.uniform_(0.5, 2)
    layer = accept_low_precision_parameters(nn.Sequential(nn.BatchNorm2d(6)))[0]
    layer.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in reference.state_dict().items()})
    _as_deepspeed_casts_it(layer)
    layer.train(training), reference.train(training)
    x = torch.randn(8, 6, 5, 5, dtype=torch.float64) * 3 + 1
    out = layer(x.to(torch.bfloat16))
    expected = reference(x)
    # bf16 input, bf16 weight and bias (rounded once), fp32 arithmetic, bf16 output
    assert out.dtype == torch.bfloat16
    assert (out.double() - expected).abs().max() <= 0.03 * expected.abs().max()
    assert torch.allclose(layer.running_mean.double(), reference.running_mean, atol=2e-2)
    assert torch.allclose(layer.running_var.double(), reference.running_var, rtol=2e-2)


def test_fp32_layers_run_torch_s_own_forward_and_keep_their_state_names():
    plain = build_model(ModelConfig(arch="resnet10", small_input_stem=True))
    assert isinstance(plain.backbone.bn1, nn.BatchNorm2d) and type(plain.backbone.bn1) is not nn.BatchNorm2d
    keys = nn.Sequential(nn.BatchNorm2d(3)).state_dict().keys()
    assert accept_low_precision_parameters(nn.Sequential(nn.BatchNorm2d(3))).state_dict().keys() == keys
