"""Activation checkpointing under ZeRO-3 on 2 gloo ranks: ZeRO-3 partitions every weight and gathers
a module's weights in its forward hooks, and frees them after; the recomputation in the backward runs
the units' submodules again, whose hooks gather them again.  A ViT-Ti at 32 px with AdamW, 2 steps:
the weights equal the same run's without checkpointing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.checkpoint.engine_state import consolidated_weights
from trainer.checkpoint.optimizer_state import fresh_host_copy
from trainer.engine.deepspeed_setup import initialize_backbone, load_deepspeed_config
from trainer.models import ModelConfig, build_model
from trainer.optim import OptimizerSettings
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
VIT_TI = dict(arch="vit_tiny_patch16_224", patch_size=8, img_size=32, head_hidden_dim=32, feature_dim=8)
LOCAL_BATCH, STEPS = 2, 2


def _train_both(result: str) -> None:
    """Without, then with checkpointing, in one pair of processes (one start-up of DeepSpeed)."""
    dims = init_distributed()
    weights = {checkpointing: _train(checkpointing, dims) for checkpointing in (False, True)}
    if dims.rank == 0:
        torch.save(weights, result)


def _train(checkpointing: bool, dims) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(ModelConfig(**VIT_TI, activation_checkpointing=checkpointing))
    config = load_deepspeed_config(REPO / "ds_configs" / "zero3.json", micro_batch=LOCAL_BATCH)
    settings = OptimizerSettings(name="adamw", momentum=0.9, weight_decay=0.05, exclude_from_decay=True)
    engine, _ = initialize_backbone(model, config, 1e-3, settings=settings)
    engine.train()
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(1000 * step + dims.rank)
        images = torch.randn(LOCAL_BATCH, 3, 32, 32, generator=generator)
        engine.backward(engine(images).square().mean())
        engine.step()
    return consolidated_weights(engine, dims.rank == 0, fresh_host_copy)  # collective under ZeRO-3


@pytest.mark.slow  # default suite: the unit tests' exact gradients, and the ViT family test trains with it under ZeRO-3
def test_a_vit_under_zero3_trains_to_the_same_weights_with_activation_checkpointing(tmp_path):
    spawn_local_workers(_train_both, 2, str(tmp_path / "weights.pt"))
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    plain, checkpointed = weights[False], weights[True]
    initial = build_model(ModelConfig(**VIT_TI)).state_dict()
    assert plain.keys() == checkpointed.keys()
    assert not torch.equal(plain["backbone.blocks.0.attn.qkv.weight"], initial["backbone.blocks.0.attn.qkv.weight"])
    for name, weight in plain.items():
        torch.testing.assert_close(checkpointed[name], weight, rtol=1e-6, atol=1e-7, msg=name)
