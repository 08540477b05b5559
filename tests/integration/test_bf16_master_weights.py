"""Under a bf16 DeepSpeed config model.pt holds the fp32 master weights, not the module's bf16
copies, and a resume on another world size continues from exactly those masters.

2 bf16 steps on 2 ranks, saved; 1 rank resumes (a reshard: the weights come from model.pt), checks
its fp32 masters equal model.pt bit for bit, trains 2 more bf16 steps and saves again.  What the
trainer's evaluation scores (``plain_model_from_engine``) is model.pt's network on every rank.  ZeRO-2 in
``make test``, ZeRO-3 (gathered partitions) in the slow run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.integration.test_backbone_optimizer_reshard import _global_batch, _latest, _model, _weights
from trainer.checkpoint import save_checkpoint
from trainer.checkpoint.engine_state import EngineState, load_engine, plain_model_from_engine
from trainer.engine.deepspeed_setup import engine_dtype, initialize_backbone, load_deepspeed_config
from trainer.parallel import init_distributed
from trainer.parallel.deepspeed_import import safe_get_full_fp32_param
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 8


def _masters(engine) -> dict[str, torch.Tensor]:
    """The engine's fp32 master weights (collective under ZeRO)."""
    return {name: safe_get_full_fp32_param(p).float().cpu() for name, p in engine.module.named_parameters()}


def _run(stage: int, steps: list[int], resume: str | None, save_to: str) -> None:
    dims = init_distributed()
    local = GLOBAL_BATCH // dims.world_size
    config = load_deepspeed_config(REPO / "ds_configs" / f"zero{stage}_bf16.json", micro_batch=local)
    engine, _ = initialize_backbone(_model(), config, lr=0.1, momentum=0.9, weight_decay=1e-3)
    assert engine_dtype(engine) == torch.bfloat16
    if resume is not None:
        load_engine(Path(resume), engine, dims, log=lambda message: None)
        masters, saved = _masters(engine), _weights(Path(resume))
        for name, weight in saved.items():  # the resume continues from the fp32 masters, exactly
            assert torch.equal(masters[name], weight), f"rank {dims.rank}: {name} is not model.pt's"
    for step in steps:
        inputs, targets = _global_batch(step)
        mine = slice(dims.rank * local, (dims.rank + 1) * local)
        loss = nn.functional.mse_loss(engine(inputs[mine].to(torch.bfloat16)).float(), targets[mine])
        engine.backward(loss)
        engine.step()
    save_checkpoint(Path(save_to), steps[-1] + 1, {"engine": EngineState(engine)}, dims, keep=1)
    masters = _masters(engine)
    # What the trainer's evaluation scores, on every rank, is model.pt's network (fp32 masters)
    evaluated = plain_model_from_engine(engine, _model()).state_dict()
    saved = _weights(_latest(Path(save_to)))
    assert evaluated.keys() == saved.keys()
    for name, weight in saved.items():
        assert torch.equal(evaluated[name], weight.to(evaluated[name].dtype)), f"rank {dims.rank}: evaluated {name}"
    if dims.rank == 0:
        for name, weight in masters.items():
            assert torch.equal(saved[name], weight), f"model.pt's {name} is not the fp32 master"
        rounded = [name for name, weight in saved.items() if torch.equal(weight, weight.bfloat16().float())]
        assert not rounded, f"model.pt holds bf16-rounded weights: {rounded}"


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_bf16_checkpoint_holds_fp32_masters_and_a_resharded_resume_continues_from_them(stage, tmp_path):
    spawn_local_workers(_run, 2, stage, [0, 1], None, str(tmp_path / "on_two"))
    spawn_local_workers(_run, 1, stage, [2, 3], str(_latest(tmp_path / "on_two")), str(tmp_path / "on_one"))
    assert _latest(tmp_path / "on_one").name != _latest(tmp_path / "on_two").name  # saved after steps 2-3
