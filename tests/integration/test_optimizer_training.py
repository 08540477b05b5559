"""The optimizers through the real trainer on 2 CPU ranks: AdamW with clipping and a weight-decay
schedule, and SwAV's LARS recipe with its prototypes, train with finite losses, and each
checkpoint holds the state of the optimizer the job names (AdamW's step counter included)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers.training import FAST, latest_checkpoint, run_train
from trainer.checkpoint.checkpoint_files import OPTIMIZER_FILE

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # the wiring; the optimizers have their own tests


def _losses(run_dir) -> list[float]:
    lines = (run_dir / "logs" / "rank-00000.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if "loss" in record and "step" in record]


@pytest.mark.parametrize("config, overrides, state_keys", [
    ("digits_cpu.yaml", ["optim.name=adamw", "optim.base_lr=0.001", "optim.weight_decay=0.05",
                         "optim.weight_decay_end=0.2", "optim.clip_grad_norm=1.0",
                         "deepspeed_config=ds_configs/zero2.json"], {"exp_avg", "exp_avg_sq", "step"}),
    pytest.param("swav_demo_cpu.yaml", ["optim.name=lars", "optim.base_lr=4.8", "optim.base_batch=4096",
                                        "optim.exclude_from_decay=false", "deepspeed_config=ds_configs/zero1.json"],
                 {"momentum_buffer"}, id="swav-lars"),
])
def test_a_job_trains_with_the_optimizer_it_names(config, overrides, state_keys, digits_split, tmp_path):
    run_train(tmp_path, digits_split, 2, FAST + overrides + ["max_steps=4", "logging.log_every=1"], config=config)
    losses = _losses(tmp_path)
    assert len(losses) >= 4 and all(math.isfinite(loss) for loss in losses), losses
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.name == "step_000000004"
    saved = torch.load(checkpoint / OPTIMIZER_FILE, weights_only=True)
    assert saved and all(set(state) == state_keys for state in saved.values())
    if "step" in state_keys:
        assert {float(state["step"]) for state in saved.values()} == {4.0}
