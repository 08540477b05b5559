"""AdamW's state survives a change of world size under ZeRO, its step counter included: 2 steps on
2 ranks, saved, then 2 on 3 ranks resumed from it, end where 4 steps on 2 ranks end (weights, both
moments, step 4).  AdamW's bias correction reads the counter: restarted at 0 it would scale the
first resumed updates by 1 / (1 - 0.9) instead of 1 / (1 - 0.9^3), and the weights would differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.checkpoint import save_checkpoint
from trainer.checkpoint.checkpoint_files import complete_checkpoints
from trainer.checkpoint.engine_state import EngineState, load_engine
from trainer.checkpoint.optimizer_state import full_optimizer_state
from trainer.engine.deepspeed_setup import initialize_backbone, load_deepspeed_config
from trainer.optim import OptimizerSettings
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH, WIDTH = 12, 6  # split over 2 or 3 ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _run(stage: int, steps: list[int], resume: str | None, save_to: str | None, result: str) -> None:
    dims = init_distributed()
    local = GLOBAL_BATCH // dims.world_size
    config = load_deepspeed_config(REPO / "ds_configs" / f"zero{stage}.json", micro_batch=local)
    settings = OptimizerSettings(name="adamw", weight_decay=0.05, betas=(0.9, 0.999))
    engine, _ = initialize_backbone(_model(), config, lr=0.01, settings=settings)
    if resume is not None:
        load_engine(Path(resume), engine, dims, log=lambda message: None)
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)
        inputs, targets = torch.randn(GLOBAL_BATCH, WIDTH, generator=generator), torch.randn(GLOBAL_BATCH, 3,
                                                                                            generator=generator)
        mine = slice(dims.rank * local, (dims.rank + 1) * local)
        engine.backward(nn.functional.mse_loss(engine(inputs[mine]), targets[mine]))
        engine.step()
    if save_to is not None:
        save_checkpoint(Path(save_to), steps[-1] + 1, {"engine": EngineState(engine)}, dims, keep=1)
    state = full_optimizer_state(engine, keep=dims.rank == 0)  # collective under ZeRO
    if dims.rank == 0:
        torch.save(state, result)


# default suite: the step counter carried through a checkpoint (tests/unit/test_optimizer_state_keys.py)
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_adamw_resumed_on_another_number_of_ranks_carries_its_step_counter(stage, tmp_path):
    spawn_local_workers(_run, 2, stage, [0, 1, 2, 3], None, str(tmp_path / "reference"), str(tmp_path / "reference.pt"))
    spawn_local_workers(_run, 2, stage, [0, 1], None, str(tmp_path / "first"), str(tmp_path / "first.pt"))
    resume = complete_checkpoints(tmp_path / "first")[-1]
    spawn_local_workers(_run, 3, stage, [2, 3], str(resume), str(tmp_path / "second"), str(tmp_path / "second.pt"))

    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    resharded = torch.load(tmp_path / "second.pt", weights_only=True)
    assert reference.keys() == resharded.keys() and len(reference) == 6
    for name, state in reference.items():
        assert set(state) == {"exp_avg", "exp_avg_sq", "step"}
        assert float(resharded[name]["step"]) == float(state["step"]) == 4.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(resharded[name][key], state[key], rtol=1e-5, atol=1e-7)
    weights, expected = (torch.load(complete_checkpoints(tmp_path / run)[-1] / "model.pt", weights_only=True)
                         for run in ("second", "reference"))
    for name, weight in expected.items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-5, atol=1e-6)
