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


def _cases():
    for family in FAMILIES:
        for objective in OBJECTIVES:
            # default suite: a ViT with the paper's objective; the other pairs repeat the wiring
            marks = () if (family, objective) == ("vit", "instance") else (pytest.mark.slow,)
            yield pytest.param(family, objective, marks=marks, id=f"{family}-{objective}")


@pytest.mark.parametrize("family,objective", list(_cases()))
def test_the_smallest_of_each_family_trains_two_steps_with_each_objective(family, objective, tiny_digits_split,
                                                                         tmp_path):
    config, settings = OBJECTIVES[objective]
    overrides = ["data.loader.batch_size=32", "max_steps=2", "logging.log_every=1", "parallel.deterministic=true",
                 "eval.knn_at_end=false", *settings, *FAMILIES[family]]
    result = run_train(tmp_path, tiny_digits_split, 2, overrides, config=config)
    losses = step_losses(tmp_path)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.name == "step_000000002"
    network = torch.load(checkpoint / "model.pt", weights_only=True)
    assert FIRST_WEIGHT[family] in network
    checks = replica_checks(tmp_path, 2)[0]  # no entry differs across the ranks at the save
    assert [c["moment"] for c in checks] == ["save"]
    # the MLP head's BatchNorm: its per-rank running statistics were averaged into the saved network
    assert checks[0]["batch_norm_spread"] > 0
    trainer = json.loads((checkpoint / "trainer.json").read_text())
    assert trainer["fingerprint"]["model.arch"] == FAMILIES[family][0].split("=")[1]
    if objective == "instance":
        assert "objective instance ready" in result.stdout + result.stderr  # the contrastive prior's pass ran


@pytest.mark.slow  # default suite: the ViT under ZeRO-0 above; this is the stage that partitions its weights
def test_a_vit_trains_under_zero3(tiny_digits_split, tmp_path):
    """ZeRO-3 partitions every tensor, the position embedding and class token that timm's forward reads
    directly included: they are gathered for the ViT's own forward."""
    overrides = ["data.loader.batch_size=32", "max_steps=2", "logging.log_every=1", "eval.knn_at_end=false",
                 "deepspeed_config=ds_configs/zero3.json", *FAMILIES["vit"]]
    run_train(tmp_path, tiny_digits_split, 2, overrides)
    losses = step_losses(tmp_path)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
    network = torch.load(latest_checkpoint(tmp_path) / "model.pt", weights_only=True)
    assert network["backbone.pos_embed"].shape == (1, 65, 192)
    replica_checks(tmp_path, 2)
