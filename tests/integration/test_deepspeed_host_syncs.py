"""The shipped GPU job configs run a DeepSpeed step that reads nothing back to the host.

A host read in the step (``.item()``, a mask sized by the data) stalls the host until the device has
finished everything queued before it, every step.  DeepSpeed's bf16 optimizers read a flag or a
norm every step (an overflow check, the gradient norm); the shipped configs turn them off or run bf16
through ``torch.autocast``.  Here the reads are caught as the ops that make them
(``tests/helpers/data_dependent_ops.py``), on CPU ranks, in the backward and the step of a
ResNet, for every shipped DeepSpeed config, against ``trainer.engine.deepspeed_host_syncs``.  A
host-to-device copy of a Python number, which CUDA's sync-debug mode also flags, is not an op and is
not seen here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.data_dependent_ops import DataDependentOps
from trainer.engine.deepspeed_host_syncs import host_reads_per_step
from trainer.engine.deepspeed_setup import engine_dtype, initialize_backbone, load_deepspeed_config
from trainer.models import ModelConfig, build_model
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

# ~50 s: slow; the shipped configs' keys are checked in tests/unit/test_deepspeed_config.py
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _reads_per_step(ds_files: list[str], out: str) -> None:
    """Per DeepSpeed file: the data-dependent ops of the third step's backward and optimizer step."""
    dims = init_distributed()
    found = {}
    for ds_file in ds_files:
        torch.manual_seed(0)
        model = build_model(ModelConfig(arch="resnet10", head_hidden_dim=32, feature_dim=8))
        engine, _ = initialize_backbone(model, load_deepspeed_config(Path(ds_file), micro_batch=4), lr=0.1)
        images = torch.randn(4, 3, 32, 32).to(engine_dtype(engine))
        for _ in range(3):  # the first steps create state; the third is a steady one
            with DataDependentOps() as ops:
                engine.backward(engine(images).float().pow(2).mean())
                engine.step()
        found[ds_file] = ops.ops
    if dims.rank == 0:
        Path(out).write_text(json.dumps(found))


def test_every_shipped_deepspeed_config_reads_the_host_exactly_when_the_rules_say(tmp_path):
    """The shipped GPU job configs' file reads nothing; zero1_bf16, zero3_bf16 and zero0_bf16 are the
    controls that show the check can fail."""
    ds_files = sorted(str(path) for path in (REPO / "ds_configs").glob("*.json"))
    out = tmp_path / "reads.json"
    spawn_local_workers(_reads_per_step, 2, ds_files, str(out))
    found = json.loads(out.read_text())
    predicted = {f: bool(host_reads_per_step(load_deepspeed_config(Path(f), micro_batch=4))) for f in ds_files}
    assert {f: bool(ops) for f, ops in found.items()} == predicted
    assert sum(predicted.values()) >= 3  # the controls
