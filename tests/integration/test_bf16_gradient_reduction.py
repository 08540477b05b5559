"""Under the shipped bf16 DeepSpeed configs the backbone's gradients are averaged over the ranks in
fp32, not bf16.

Two ranks hold gradients 1 and 2^-9 of one weight: in bf16 their sum rounds back to 1 (8 bits of
mantissa), in fp32 it is exact.  After one SGD step of learning rate 1 the fp32 master weight must
be -(1 + 2^-9) / 2 (stages 1-3, and stage 0 under torch.autocast, whose weights are the fp32 masters;
without ZeRO the bf16 engine's communication dtype is checked)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.engine.deepspeed_setup import initialize_backbone, load_deepspeed_config
from trainer.parallel import init_distributed
from trainer.parallel.deepspeed_import import safe_get_full_fp32_param
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SMALL = 2.0**-9  # exact in bf16, below bf16's resolution next to 1


def _one_step(name: str, result_file: str) -> None:
    dims = init_distributed()
    config = load_deepspeed_config(REPO / "ds_configs" / f"{name}.json", micro_batch=1)
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    engine, _ = initialize_backbone(model, config, lr=1.0, momentum=0.0, weight_decay=0.0)
    assert engine.communication_data_type == torch.float32
    x = torch.tensor([[1.0 if dims.rank == 0 else SMALL]], dtype=torch.bfloat16)
    engine.backward(engine(x).float().sum())  # d(loss)/d(weight) = x on each rank
    engine.step()
    if name == "zero0_bf16":  # bf16 gradients, no fp32 master DeepSpeed would hand out (see its _comment)
        return
    weight = engine.module.weight
    if config.get("torch_autocast", {}).get("enabled"):  # the fp32 weight is the master
        assert weight.dtype == torch.float32
        master = weight.item()
    else:
        master = safe_get_full_fp32_param(weight).float().item()  # collective
    if dims.rank == 0:
        Path(result_file).write_text(repr(master))


SLOW = pytest.mark.slow


@pytest.mark.parametrize("name", ["zero0_autocast_bf16", pytest.param("zero0_bf16", marks=SLOW),
                                  pytest.param("zero1_bf16", marks=SLOW), pytest.param("zero2_bf16", marks=SLOW),
                                  pytest.param("zero3_bf16", marks=SLOW)])
def test_gradients_are_averaged_in_fp32(name, tmp_path):
    result = tmp_path / "master.txt"
    spawn_local_workers(_one_step, 2, name, str(result))
    if name != "zero0_bf16":
        assert float(result.read_text()) == -(1.0 + SMALL) / 2
