"""LARS steps the same weights under every ZeRO stage as a single float64 LARC does on the whole
batch: 5 steps on 2 and 3 gloo ranks, rtol 1e-5.  Its trust ratio needs whole-tensor norms; ZeRO-1/2
cut the flat parameters across tensors (the first weight straddles the partition boundary, checked
below) and ZeRO-3 splits every tensor, so a rank's own pieces would give wrong ratios.  The excluded
group (LayerNorm, biases) is plain SGD with momentum and no decay, as the reference's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.lars_reference import larc_sgd_step
from trainer.checkpoint.engine_state import consolidated_weights
from trainer.checkpoint.optimizer_state import fresh_host_copy
from trainer.engine.deepspeed_setup import engine_dtype, initialize_backbone, load_deepspeed_config
from trainer.optim import OptimizerSettings, optimizer_partitions
from trainer.optim.param_groups import excluded_from_decay
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH, WIDTH, STEPS = 12, 7, 5  # 12 images split over 2 or 3 ranks
LR, MOMENTUM, WEIGHT_DECAY, TRUST = 1.0, 0.9, 1e-2, 0.02  # a large trust coefficient: the weights move


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, WIDTH, generator=generator), torch.randn(GLOBAL_BATCH, 5, generator=generator)


def _settings() -> OptimizerSettings:
    return OptimizerSettings(name="lars", momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, trust_coefficient=TRUST,
                             exclude_from_decay=True)


def _straddles(partitions) -> bool:
    """Some tensor has a piece on this rank smaller than the whole tensor."""
    return any(f.numel < getattr(p.params[f.row], "ds_numel", p.params[f.row].numel())
               for p in partitions for f in p.fragments)


def _train(stage: int, result: str) -> None:
    dims = init_distributed()
    local = GLOBAL_BATCH // dims.world_size
    config = load_deepspeed_config(REPO / "ds_configs" / f"zero{stage}.json", micro_batch=local)
    engine, optimizer = initialize_backbone(_model(), config, LR, settings=_settings())
    straddles = _straddles(optimizer_partitions(optimizer))
    for step in range(STEPS):
        inputs, targets = _batch(step)
        mine = slice(dims.rank * local, (dims.rank + 1) * local)
        outputs = engine(inputs[mine].to(engine_dtype(engine))).float()
        engine.backward(nn.functional.mse_loss(outputs, targets[mine]))
        engine.step()
    weights = consolidated_weights(engine, dims.rank == 0, fresh_host_copy)  # collective under ZeRO
    if dims.rank == 0:
        torch.save({"weights": weights, "straddles": straddles}, result)


def _reference() -> dict[str, torch.Tensor]:
    """The same 5 steps in float64 on one process, the whole batch at once."""
    model = _model().double()
    excluded = excluded_from_decay(model)
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    buffers = [None] * len(params)
    for step in range(STEPS):
        inputs, targets = _batch(step)
        loss = nn.functional.mse_loss(model(inputs.double()), targets.double())
        grads = torch.autograd.grad(loss, params)
        buffers = larc_sgd_step(params, list(grads), buffers, LR, MOMENTUM,
                                [0.0 if n in excluded else WEIGHT_DECAY for n in names],
                                [n not in excluded for n in names], TRUST)
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("stage, ranks", [
    (2, 2),
    *(pytest.param(stage, ranks, marks=pytest.mark.slow) for stage, ranks in
      ((0, 2), (1, 2), (3, 2), (0, 3), (1, 3), (2, 3), (3, 3))),
])
def test_lars_under_zero_matches_a_float64_reference_with_tensors_straddling_partitions(stage, ranks, tmp_path):
    spawn_local_workers(_train, ranks, stage, str(tmp_path / "result.pt"))
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["straddles"] == (stage > 0)
    reference, initial = _reference(), dict(_model().named_parameters())
    for name, expected in reference.items():
        assert (expected - initial[name].double()).abs().max() > 1e-3, f"{name} hardly moved: a weak check"
        torch.testing.assert_close(result["weights"][name].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_bf16_optimizer_of_stage_1_steps_lars_as_zero_2_in_bf16_does(tmp_path):
    """zero1_bf16 runs DeepSpeed's BF16_Optimizer, another flat partitioning (fp32 gradients): with
    bf16 compute the float64 reference is out of reach, ZeRO-2 in bf16 (checked in fp32 above) is not."""
    for stage in ("1_bf16", "2_bf16"):
        spawn_local_workers(_train, 2, stage, str(tmp_path / f"{stage}.pt"))
    bf16_optimizer, zero_2 = (torch.load(tmp_path / f"{stage}.pt", weights_only=True) for stage in ("1_bf16", "2_bf16"))
    assert bf16_optimizer["straddles"] and zero_2["straddles"]
    for name, weight in zero_2["weights"].items():
        torch.testing.assert_close(bf16_optimizer["weights"][name], weight, rtol=1e-5, atol=1e-6)
