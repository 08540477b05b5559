"""The backbone planned per ZeRO stage, for every registered backbone and optimizer: the optimizer's
state from its registry entry, ZeRO's partitions at the right stages, activations with and without
checkpointing, and the stage recommended (the lowest that fits, or what would make one fit)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from trainer.models import ModelConfig, build_model
from trainer.models.backbones import backbone_names
from trainer.models.profile import model_profile
from trainer.optim import optimizer_names, optimizer_spec
from trainer.planning import GIB, PlanInput, backbone_breakdown, predict, recommend_stage

# A CPU rank has no ZeRO buckets, so each stage needs strictly less than the one below it.
BASE = PlanInput(mode="dhp", num_classes=10_000, ranks=4, batch=64, backbone="resnet18", image_size=32,
                 dtype="bfloat16", optimizer="adamw", device="cpu")


def _parameters(arch: str, **sizes) -> int:
    """Counted on a network built here on the meta device, apart from the planner's profile."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(ModelConfig(arch=arch, **sizes)).parameters())


def test_adamw_keeps_twice_the_optimizer_state_of_sgd_and_lars_as_much_as_sgd():
    plan = replace(BASE, dtype="float32")  # no fp32 master copy: the optimizer's own state alone
    state = {name: backbone_breakdown(replace(plan, optimizer=name))["backbone optimizer state"]
             for name in ("sgd", "lars", "adamw")}
    assert state["adamw"] == 2 * state["sgd"] == 2 * state["lars"] == _parameters("resnet18") * 8
    # Under bf16 each adds DeepSpeed's fp32 master weights.
    assert backbone_breakdown(BASE)["backbone optimizer state"] == _parameters("resnet18") * (8 + 4)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_partitions_optimizer_state_then_gradients_then_weights(stage):
    parameters, ranks = _parameters("resnet18"), BASE.ranks
    planned = backbone_breakdown(replace(BASE, zero_stage=stage))
    assert planned["backbone optimizer state"] == int(parameters * 12 / (ranks if stage >= 1 else 1))
    assert planned["backbone gradients"] == int(parameters * 2 / (ranks if stage >= 2 else 1))
    assert planned["backbone weights"] == int(parameters * 2 / (ranks if stage >= 3 else 1))


def test_activation_checkpointing_keeps_the_profiles_checkpointed_bytes():
    profile = model_profile(ModelConfig(arch="resnet18"), 32)
    local_images = BASE.batch // BASE.ranks * BASE.views
    plain = backbone_breakdown(BASE)["backbone activations"]
    checkpointed = backbone_breakdown(replace(BASE, activation_checkpointing=True))["backbone activations"]
    assert plain == profile.activation_bytes // 2 * local_images  # bf16: half the profile's fp32 bytes
    assert checkpointed == profile.checkpointed_activation_bytes // 2 * local_images < plain


@pytest.mark.parametrize("name", backbone_names())
def test_every_backbone_is_planned_with_every_optimizer(name):
    sizes = {"img_size": 32, "patch_size": 4} if name.startswith("vit") else {}
    plan = PlanInput(mode="dhp", num_classes=1000, ranks=2, batch=4, backbone=name, image_size=32, **sizes)
    parameters = _parameters(name, **sizes)
    for optimizer in optimizer_names():
        planned = predict(replace(plan, optimizer=optimizer))
        bytes_per_parameter = optimizer_spec(optimizer).state_bytes_per_parameter
        assert planned["backbone optimizer state"] == parameters * bytes_per_parameter, optimizer
        assert recommend_stage(replace(plan, optimizer=optimizer), 80 * GIB).stage == 0
    checkpointed = predict(replace(plan, activation_checkpointing=True))["backbone activations"]
    assert 0 < checkpointed <= predict(plan)["backbone activations"]


def _totals(plan: PlanInput) -> list[int]:
    return [sum(predict(replace(plan, zero_stage=stage)).values()) for stage in range(4)]


def test_the_lowest_stage_that_fits_is_recommended():
    totals = _totals(BASE)
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    assert recommend_stage(BASE, totals[0]).stage == 0
    for stage in (1, 2, 3):
        between = (totals[stage - 1] + totals[stage]) // 2  # stage fits, the one below it does not
        recommendation = recommend_stage(BASE, between)
        assert recommendation.stage == stage
        assert recommendation.as_json()["recommended_zero_stage"] == stage
        assert recommendation.text().startswith(f"recommended: ZeRO-{stage} ")


def test_when_no_stage_fits_it_says_so_and_what_would_fit():
    heavy = replace(BASE, image_size=224, batch=256)  # activations outweigh the training state
    totals, checkpointed = _totals(heavy), _totals(replace(heavy, activation_checkpointing=True))
    assert checkpointed[2] < totals[3]
    capacity = (checkpointed[2] + min(checkpointed[1], totals[3])) // 2  # ZeRO-2 with checkpointing, nothing without
    recommendation = recommend_stage(heavy, capacity)
    assert recommendation.stage is None and recommendation.with_checkpointing.stage == 2
    assert recommendation.text().startswith(f"no ZeRO stage fits in {capacity / GIB:g} GiB; with activation "
                                            "checkpointing ZeRO-2 fits")
    doubled = _totals(replace(BASE, ranks=8))
    ranks, fit = recommend_stage(BASE, doubled[3]).more_ranks  # 8 ranks (same global batch) fit at ZeRO-3
    assert ranks == 8 and fit.stage == min(s for s in range(4) if doubled[s] <= doubled[3])
    hopeless = recommend_stage(BASE, 1)
    assert hopeless.stage is None and "nor with activation checkpointing or more ranks" in hopeless.text()


def test_plan_command_writes_every_stage_and_the_recommendation(tmp_path, capsys):
    from trainer.cli import main

    path = tmp_path / "plan.json"
    args = ["plan", "--num-classes", "10000", "--ranks", "4", "--batch", "64", "--backbone", "resnet18",
            "--image-size", "32", "--dtype", "bfloat16", "--optimizer", "adamw", "--activation-checkpointing",
            "--gpu-memory-gib", "1.5", "--json", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    for mode, planned in json.loads(path.read_text()).items():
        stages = planned["zero_stages"]
        assert list(stages) == ["0", "1", "2", "3"], mode
        fitting = [int(stage) for stage, figures in stages.items() if figures["total_bytes"] <= 1.5 * GIB]
        assert planned["recommended_zero_stage"] == min(fitting, default=None), mode
        assert planned["recommendation"] in out
        assert planned["breakdown"]["backbone activations"] == 16 * 2 * (
            model_profile(ModelConfig(arch="resnet18"), 32).checkpointed_activation_bytes // 2)
    assert "optimizer adamw" in out and "activation checkpointing on" in out
