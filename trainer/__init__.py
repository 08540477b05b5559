"""instcls trainer: backbone, sharded instance classifier, engine and tools.

The Python API, for a script or a notebook (one process; several ranks: `instcls launch`)::

    import trainer

    config = trainer.load_job_config("configs/demo_cpu.yaml", overrides=["optim.epochs=4"])
    result = trainer.train(config)

``import trainer`` is cheap: it imports neither torch nor DeepSpeed and probes no device; each
name below is imported the first time it is used (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["JobConfig", "TrainResult", "Trainer", "load_job_config", "train"]

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ imports on first use
    from trainer.config import JobConfig, load_job_config
    from trainer.engine.trainer import Trainer, TrainResult
    from trainer.engine.training_job import train


def __getattr__(name: str):
    if name in ("JobConfig", "load_job_config"):
        from trainer import config as module
    elif name in ("Trainer", "TrainResult"):
        from trainer.engine import trainer as module
    elif name == "train":
        from trainer.engine import training_job as module
    else:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
