"""DeepSpeed's real engine, for the shipped DeepSpeed configs as ``load_deepspeed_config`` reads them
(the GPU jobs' file in the default suite, every file in the slow tier),
makes the training thread wait for the whole device 0 times a step from step 3 on (forward, backward,
``step()``; 2 CPU ranks, gloo).  With the throughput timer turned back on it waits twice a step, at
the timer's start and stop, named by source line: the count can fail.  The waits are counted where
they are called (``get_accelerator().synchronize``, ``torch.cuda.synchronize``, stream and event
``synchronize``), which CUDA's sync-debug mode does not report, and on CPU ranks too."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from trainer.dry_run.device_waits import DeviceWaitCounter
from trainer.engine.deepspeed_setup import engine_dtype, initialize_backbone, load_deepspeed_config
from trainer.models import ModelConfig, build_model
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
TIMER_ON = "zero0.json with timers.throughput.enabled"


def _waits_per_step(ds_files: list[str], out: str) -> None:
    init_distributed()
    runs = {name: load_deepspeed_config(Path(name), micro_batch=4) for name in ds_files}
    runs[TIMER_ON] = {**load_deepspeed_config(REPO / "ds_configs/zero0.json", micro_batch=4),
                      "timers": {"throughput": {"enabled": True}}}
    found = {}
    training_thread = threading.get_ident()
    for name, ds_config in runs.items():
        torch.manual_seed(0)
        model = build_model(ModelConfig(arch="resnet10", small_input_stem=True, head_hidden_dim=16, feature_dim=8))
        engine, _ = initialize_backbone(model, ds_config, lr=0.1)
        images = torch.randn(4, 3, 16, 16).to(engine_dtype(engine))
        per_step = []
        with DeviceWaitCounter() as waits:
            for _ in range(STEPS):
                start = waits.mark()
                engine.backward(engine(images).float().pow(2).mean())
                engine.step()
                per_step.append([f"{w.call} at {w.where}" for w in waits.records[start:]
                                 if w.thread == training_thread])
        found[Path(name).name if name != TIMER_ON else name] = per_step
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(found))


EVERY_FILE = sorted(str(path) for path in (REPO / "ds_configs").glob("*.json"))
GPU_JOBS = [str(REPO / "ds_configs/zero0_autocast_bf16.json")]  # the shipped GPU job configs' file


@pytest.mark.parametrize("ds_files", [GPU_JOBS, pytest.param(EVERY_FILE, marks=pytest.mark.slow)],
                         ids=["gpu-jobs-file", "every-file"])
def test_no_shipped_config_waits_for_the_device_in_a_step_and_the_timer_would_twice(ds_files, tmp_path):
    out = tmp_path / "waits.json"
    spawn_local_workers(_waits_per_step, 2, ds_files, str(out))
    found = json.loads(out.read_text())
    assert len(found) == len(ds_files) + 1
    for name, per_step in found.items():
        if name == TIMER_ON:
            continue
        assert all(step == [] for step in per_step[2:]), (name, per_step)
    with_timer = found[TIMER_ON]
    assert [len(step) for step in with_timer[2:]] == [2] * (STEPS - 2), with_timer
    assert all("deepspeed/utils/timer.py" in wait for step in with_timer[2:] for wait in step), with_timer
    assert sorted(wait.rsplit(" in ", 1)[1] for wait in with_timer[2]) == ["start", "stop"], with_timer
