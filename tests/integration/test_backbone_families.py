"""The smallest member of each backbone family trains with every objective through the real trainer
on 2 CPU ranks: two steps, a save, and the replicated-state check at the save finding nothing that
differs across ranks.  A ViT has BatchNorm only in the MLP head, whose running statistics are still
averaged; the contrastive prior fills W from the random ViT; SwAV's 16 px small crops go through
the ViT built for 32 px (its position grid resampled)."""

import json
import math

import pytest
import torch

from tests.helpers.training import latest_checkpoint, replica_checks, run_train, step_losses

pytestmark = pytest.mark.integration

FAMILIES = {
    "resnet": ["model.arch=resnet10"],
    "vit": ["model.arch=vit_tiny_patch16_224", "model.patch_size=4", "model.img_size=32"],
}
OBJECTIVES = {
    "instance": ("digits_cpu.yaml", []),
    "pic": ("pic_demo_cpu.yaml", ["objective.queue_size=32"]),
    "swav": ("swav_demo_cpu.yaml", []),
}
FIRST_WEIGHT = {"resnet": "backbone.conv1.weight", "vit": "backbone.pos_embed"}


# The default suite's pair trains the ViT as the ViT configs do (at patch 8, a quarter of the
# tokens): AdamW with the classifier's own learning rate, ZeRO-3 and activation checkpointing (each
# checked for exact numbers on its own: test_activation_checkpointing*.py,
# test_objective_learning_rate.py, test_lars_zero.py).
VIT_RECIPE = ["model.patch_size=8", "optim.name=adamw", "optim.base_lr=0.001", "optim.objective_base_lr=0.48",
              "optim.weight_decay=0.05", "model.activation_checkpointing=true",
              "deepspeed_config=ds_configs/zero3.json"]


def _cases():
    for family in FAMILIES:
        for objective in OBJECTIVES:
            # default suite: a ViT with the paper's objective; the other pairs repeat the wiring
            default = (family, objective) == ("vit", "instance")
            yield pytest.param(family, objective, VIT_RECIPE if default else [],
                               marks=() if default else (pytest.mark.slow,), id=f"{family}-{objective}")


@pytest.mark.parametrize("family,objective,recipe", list(_cases()))
def test_the_smallest_of_each_family_trains_two_steps_with_each_objective(family, objective, recipe,
                                                                         tiny_digits_split, tmp_path):
    config, settings = OBJECTIVES[objective]
    overrides = ["data.loader.batch_size=32", "max_steps=2", "logging.log_every=1", "parallel.deterministic=true",
                 "eval.knn_at_end=false", *settings, *FAMILIES[family], *recipe]
    result = run_train(tmp_path, tiny_digits_split, 2, overrides, config=config)
    losses = step_losses(tmp_path)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.name == "step_000000002"
    network = torch.load(checkpoint / "model.pt", weights_only=True)
    assert FIRST_WEIGHT[family] in network
    if family == "vit":  # ZeRO-3 gathered the position embedding timm's forward reads directly: a patch grid + 1
        patch = 8 if "model.patch_size=8" in recipe else 4
        assert network["backbone.pos_embed"].shape == (1, (32 // patch) ** 2 + 1, 192)
    checks = replica_checks(tmp_path, 2)[0]  # no entry differs across the ranks at the save
    assert [c["moment"] for c in checks] == ["save"]
    # the MLP head's BatchNorm: its per-rank running statistics were averaged into the saved network
    assert checks[0]["batch_norm_spread"] > 0
    trainer = json.loads((checkpoint / "trainer.json").read_text())
    assert trainer["fingerprint"]["model.arch"] == FAMILIES[family][0].split("=")[1]
    if objective == "instance":
        assert "objective instance ready" in result.stdout + result.stderr  # the contrastive prior's pass ran
