"""DeepSpeed's own checkpoint files (ZeRO 1, 2, 3, fp32) pass the safe-unpickler check that guards
its ``weights_only=False`` load, and load back afterwards; on 2 gloo ranks."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.checkpoint.safe_load import refuse_pickled_code
from trainer.engine.deepspeed_setup import initialize_backbone, load_deepspeed_config
from trainer.models import ModelConfig, build_model
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration


def _save_check_load(folder: str):
    init_distributed()
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = build_model(ModelConfig(arch="resnet18", head_hidden_dim=16, feature_dim=8))
        engine, _ = initialize_backbone(model, load_deepspeed_config(f"ds_configs/zero{stage}.json", 4), 0.1, 0.9, 0.0)
        engine.backward(engine(torch.randn(4, 3, 32, 32)).sum())
        engine.step()
        directory = Path(folder) / f"zero{stage}"
        engine.save_checkpoint(str(directory), tag="state", save_latest=False)
        dist.barrier()
        assert any(directory.rglob("*optim_states.pt")), stage
        refuse_pickled_code(directory)  # raises on any file the safe unpickler refuses
        engine.load_checkpoint(str(directory), tag="state", load_lr_scheduler_states=False)


def test_zero_checkpoints_pass_the_safe_unpickler(tmp_path):
    spawn_local_workers(_save_check_load, 2, str(tmp_path))
