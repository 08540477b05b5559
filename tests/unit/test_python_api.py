"""The package's Python API: ``import trainer`` is cheap and probes no device, and every exported
name resolves on first use."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.training import REPO

IMPORT_ONLY = """
import json, os, sys, threading
import trainer
torch = sys.modules.get("torch")
print(json.dumps({
    "threads": threading.active_count(),
    "torch": torch is not None,
    "cuda_initialized": bool(torch is not None and torch.cuda.is_initialized()),
    "deepspeed": "deepspeed" in sys.modules,
    "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
}))
for name in trainer.__all__:
    getattr(trainer, name)
try:
    trainer.no_such_name
except AttributeError as error:
    missing = str(error)
print(json.dumps({
    "resolved": {name: getattr(trainer, name).__module__ for name in trainer.__all__},
    "listed": [name for name in trainer.__all__ if name in dir(trainer)],
    "missing": missing,
    "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
    "tensorboard": "tensorboard" in sys.modules,
}))
"""


@pytest.fixture(scope="module")
def fresh_interpreter():
    """What a fresh interpreter sees after ``import trainer``, then after resolving ``__all__``."""
    environ = {name: value for name, value in os.environ.items() if name != "DS_ACCELERATOR"}
    done = subprocess.run([sys.executable, "-c", IMPORT_ONLY], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=environ)
    assert done.returncode == 0, done.stderr[-3000:]
    after_import, after_names = map(json.loads, done.stdout.splitlines()[-2:])
    return after_import, after_names, done.stderr


def test_import_trainer_loads_no_torch_probes_no_device_and_starts_no_thread(fresh_interpreter):
    """``import trainer`` alone: no torch (so no CUDA initialisation), no DeepSpeed, no accelerator
    chosen, and the interpreter's only thread is still its main one."""
    after_import, _, _ = fresh_interpreter
    assert after_import == {"threads": 1, "torch": False, "cuda_initialized": False, "deepspeed": False,
                            "ds_accelerator": None}


def test_every_exported_name_resolves_and_deepspeed_is_told_its_accelerator_first(fresh_interpreter):
    """Each name of ``trainer.__all__`` resolves (and is listed by ``dir``); an unknown one is an
    AttributeError.  Resolving ``Trainer`` imports DeepSpeed, which finds ``DS_ACCELERATOR`` set
    ("cpu": the suite hides GPUs) and so does not warn that it fell back to the CPU; the optional
    tensorboard package is not imported."""
    _, after_names, stderr = fresh_interpreter
    assert after_names["resolved"] == {"JobConfig": "trainer.config", "load_job_config": "trainer.config",
                                       "Trainer": "trainer.engine.trainer", "TrainResult": "trainer.engine.trainer",
                                       "train": "trainer.engine.training_job"}
    assert after_names["listed"] == ["JobConfig", "TrainResult", "Trainer", "load_job_config", "train"]
    assert "no_such_name" in after_names["missing"]
    assert after_names["ds_accelerator"] == "cpu"
    assert "Setting accelerator" not in stderr, stderr[-2000:]
    assert after_names["tensorboard"] is False


def test_train_takes_overrides_only_with_a_config_file():
    """A loaded config already holds its overrides: ``train(config, overrides)`` says where they go
    instead of silently dropping them."""
    from trainer.config import ConfigError, load_job_config
    from trainer.engine.training_job import train

    config = load_job_config(REPO / "configs" / "demo_cpu.yaml")
    with pytest.raises(ConfigError, match=r"trainer.load_job_config\(path, overrides\)"):
        train(config, overrides=["optim.epochs=1"])
