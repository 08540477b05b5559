"""A ViT-Ti at patch 4 under the MLP head: it trains on 32 px views and on multi-crop's 16 px ones
(the position grid resampled to 4 x 4), runs as a bf16 DeepSpeed engine casts it, and the
BatchNorm machinery (running-statistics averaging, per-rank statistics, the replicated-state
check) holds a network with no BatchNorm at all.  The memory profile counts its blocks.  Average
pooling scores the patch tokens' mean, and the per-image input standardisation is exact and makes
the features blind to a channel's scale and offset."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.parameter_counts import vit_trunk_parameters
from trainer.checkpoint.batch_norm_state import BatchNormState
from trainer.engine.replicated_state import OneNetwork
from trainer.models import ModelConfig, build_model
from trainer.models.profile import model_profile
from trainer.parallel.batch_norm import averaged_running_statistics, running_statistics

VIT_TI = dict(arch="vit_tiny_patch16_224", patch_size=4, img_size=32, head_hidden_dim=32, feature_dim=8)


def _images(side: int, count: int = 4, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(count, 3, side, side, generator=torch.Generator().manual_seed(side), dtype=dtype)


def _resampled_position_grid(pos_embed: torch.Tensor, side: int) -> torch.Tensor:
    """The class token's embedding kept, the 8 x 8 grid resized to ``side`` x ``side`` bicubically
    (antialiased, in float32, as timm resamples it)."""
    cls, grid = pos_embed[:, :1], pos_embed[:, 1:]
    width = grid.shape[-1]
    square = grid.reshape(1, 8, 8, width).permute(0, 3, 1, 2).float()
    resized = F.interpolate(square, size=(side, side), mode="bicubic", antialias=True, align_corners=False)
    return torch.cat([cls, resized.permute(0, 2, 3, 1).reshape(1, side * side, width).to(pos_embed.dtype)], dim=1)


def test_the_vit_tiny_trunk_and_head_train_on_32_and_16_px_views():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**VIT_TI)).double().train()
    for side in (32, 16):
        model.zero_grad()
        features = model(_images(side))
        assert features.shape == (4, 8)
        features.square().sum().backward()
        missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        assert not missing, (side, missing)  # every weight learns from either view size, position grid included
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.backbone_features(_images(16)).shape == (4, 192)  # the class token, embed_dim wide

    # A 16 px view is the network built for 16 px whose position grid is the 32 px one resampled to 4 x 4.
    reference = build_model(ModelConfig(**{**VIT_TI, "img_size": 16})).double().train()
    state = model.state_dict()
    state["backbone.pos_embed"] = _resampled_position_grid(state["backbone.pos_embed"], 4)
    reference.load_state_dict(state)
    images = _images(16)
    torch.testing.assert_close(model(images), reference(images), rtol=1e-10, atol=1e-12)


def test_a_vit_runs_with_the_parameters_a_bf16_engine_casts_at_either_view_size():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**VIT_TI))
    for parameter in model.parameters():  # DeepSpeed 0.19's bf16 cast: parameters only, buffers stay fp32
        parameter.data = parameter.data.to(torch.bfloat16)
    for side in (32, 16):
        features = model(_images(side, dtype=torch.bfloat16))
        assert features.dtype == torch.bfloat16 and torch.isfinite(features.float()).all()
        features.float().square().mean().backward()
    assert model.backbone.pos_embed.grad.dtype == torch.bfloat16


def test_a_network_without_batch_norm_passes_through_the_batch_norm_machinery(tmp_path):
    """A ViT under the linear head has no BatchNorm: nothing to average, no per-rank file to save or
    load, and the replicated-state check covers its parameters and finds them alike."""
    model = build_model(ModelConfig(**{**VIT_TI, "head": "linear"}))
    assert not [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert running_statistics(model) == {} and averaged_running_statistics(model, None) == ({}, 0.0)
    dims = SimpleNamespace(rank=0, world_size=1, data_parallel_group=None, control_group=None)
    state = BatchNormState(model)
    assert state.snapshot(tmp_path, dims, 1) == []
    records = []
    one_network = OneNetwork(model, {"batch_norm": state}, True, dims, True,
                             SimpleNamespace(write=lambda **record: records.append(record)), print)
    one_network.agree(1, "save")
    assert one_network.statistics() == {}
    assert records == [dict(event="replicated", moment="save", step=1, batch_norm_spread=0.0,
                            entries=len(model.state_dict()), diverged=[])]


def test_the_memory_profile_counts_each_vit_block_from_its_tokens_and_width():
    """ViT-Ti at patch 4 on 32 px: 65 tokens of width 192 enter each of the 12 blocks; what a block
    saves is a fixed multiple of that (layer norms, projections, the 4x MLP, attention)."""
    profile = model_profile(ModelConfig(**VIT_TI), 32)
    tokens_by_width = 65 * 192 * 4
    assert profile.blocks == 12 and profile.width == 192
    assert profile.block_input_bytes == 12 * tokens_by_width
    assert 8 <= profile.largest_block_bytes / tokens_by_width <= 40
    inside = profile.activation_bytes - profile.outside_block_bytes
    assert inside == pytest.approx(12 * profile.largest_block_bytes, rel=0.01)  # 12 identical blocks
    assert profile.checkpointed_activation_bytes < profile.activation_bytes / 3
    assert profile.trunk_parameters == vit_trunk_parameters(192, 12, 4, 32)


def test_average_pooling_scores_the_mean_of_the_patch_tokens_not_the_class_token():
    torch.manual_seed(0)
    pooled = build_model(ModelConfig(**VIT_TI, pool="avg")).double().eval()
    token = build_model(ModelConfig(**VIT_TI)).double().eval()
    # One set of weights: pooling moves the final LayerNorm after the mean (timm's fc_norm).
    state = {key.replace("backbone.fc_norm.", "backbone.norm."): value for key, value in pooled.state_dict().items()}
    token.load_state_dict(state)
    images = _images(32)
    tokens = pooled.backbone.forward_features(images)  # [b, 1 + 64, 192] before the final norm
    expected = F.layer_norm(tokens[:, 1:].mean(dim=1), (192,), pooled.backbone.fc_norm.weight,
                            pooled.backbone.fc_norm.bias, eps=pooled.backbone.fc_norm.eps)
    torch.testing.assert_close(pooled.backbone_features(images), expected, rtol=1e-12, atol=1e-12)
    class_token = F.layer_norm(tokens[:, 0], (192,), pooled.backbone.fc_norm.weight, pooled.backbone.fc_norm.bias,
                               eps=pooled.backbone.fc_norm.eps)
    torch.testing.assert_close(token.backbone_features(images), class_token, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch,extra", [("vit_tiny_patch16_224", VIT_TI), ("resnet10", {})])
def test_per_image_input_norm_sees_shapes_not_an_images_colour_and_contrast(arch, extra):
    """Each channel of each image is standardised before the trunk: scaling a channel by a positive
    factor and shifting it (another colour, another contrast) leaves the features as they were, and
    the state dict is the plain network's."""
    torch.manual_seed(0)
    settings = {**extra, "arch": arch, "head_hidden_dim": 32, "feature_dim": 8}
    model = build_model(ModelConfig(**settings, input_norm="per_image")).double().eval()
    plain = build_model(ModelConfig(**settings)).double().eval()
    assert model.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(model.state_dict())
    images = _images(32)
    recoloured = images * torch.tensor([3.0, 0.5, 1.5], dtype=images.dtype).view(1, 3, 1, 1) + torch.tensor(
        [0.2, -1.0, 4.0], dtype=images.dtype).view(1, 3, 1, 1)
    # Up to the variance's guard (1e-5 against per-channel variances of 0.25 to 9): within 1e-5.
    torch.testing.assert_close(model(recoloured), model(images), rtol=1e-3, atol=1e-5)
    assert not torch.allclose(plain(recoloured), plain(images), rtol=1e-3)  # the plain network sees the change
    mean = images.mean(dim=(2, 3), keepdim=True)
    variance = images.var(dim=(2, 3), keepdim=True, unbiased=False)
    standardised = (images - mean) / (variance + 1e-5).sqrt()
    torch.testing.assert_close(model.backbone_features(images), plain.backbone_features(standardised),
                               rtol=1e-10, atol=1e-12)
