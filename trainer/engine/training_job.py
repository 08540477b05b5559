"""One rank of a training job, from a loaded config to its result: what `instcls train` runs under a
launcher, and what ``trainer.train`` runs in the calling process (a script, a notebook)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from trainer.config import ConfigError, JobConfig, load_job_config
from trainer.engine.trainer import Trainer, TrainResult
from trainer.parallel import ParallelDims, init_distributed
from trainer.parallel.determinism import apply_determinism
from trainer.parallel.dims import shutdown_distributed
from trainer.parallel.host_memory import keep_freed_host_memory
from trainer.parallel.single_process import single_process_job
from trainer.provenance.run_start import ConfigOrigin


@contextmanager
def training_process_group(config: JobConfig) -> Iterator[ParallelDims]:
    """This process's place in ``config``'s job for the length of the block: the job torchrun (or
    the deepspeed launcher) described, or without one a job of this process alone on a free port.
    The process group is destroyed when the block ends, however it ends."""
    with single_process_job() as single:
        if single is not None:
            print(f"[instcls] {single}", file=sys.stderr)
        apply_determinism(config.parallel.deterministic)  # before init_distributed's first CUDA call
        dims = init_distributed(config.parallel.classifier_parallel_size, device=config.parallel.device,
                                timeout_s=config.parallel.collective_timeout_s)
        keep_freed_host_memory(dims.device)  # CPU ranks: chunk temporaries stop page-faulting
        try:
            yield dims
        finally:
            shutdown_distributed()


def train(config: JobConfig | str | Path, overrides: list[str] | None = None,
          resume: str | None = "auto", model_card=None) -> TrainResult:
    """Run the training job ``config`` (a job config YAML, or a ``JobConfig`` from
    ``load_job_config``) in this process, as `instcls train` runs it; returns where it stopped, its
    last checkpoint and, when it finished with eval shards set, its final scores.

    ``overrides``: ``section.field=value`` strings, as `instcls train --set` takes them (with a YAML
    path only: a loaded config already holds its own).  ``resume``: "auto" (the newest complete
    checkpoint in ``checkpoint.dir``, else a fresh start), "none", or a checkpoint's path.

    Without a launcher this is a job of one process (one GPU, or the CPU); several ranks are
    several processes: `instcls launch --nproc-per-node N -m trainer.cli train --config ...`, or
    call this in each process torchrun starts.  Errors are raised (``NonFiniteLossError``,
    ``CheckpointWriteError``, ``ConfigError``, ...) where the command would exit with their code.
    ``model_card``: with ``logging.mlflow`` on, the finished run's model card for the tracker
    (``trainer.export.card_only.model_card_of``, which `instcls train` passes); None: no card.
    """
    origin = None  # a JobConfig built in Python: run.json holds it resolved, with no file or overrides
    if not isinstance(config, JobConfig):
        origin = ConfigOrigin(Path(config), tuple(overrides or ()))
        config = load_job_config(config, overrides)
    elif overrides:
        raise ConfigError("train(config, overrides): overrides apply to a YAML file; give train() its path, or "
                          "pass them to trainer.load_job_config(path, overrides)")
    with training_process_group(config) as dims:
        return Trainer(config, dims, resume=resume, origin=origin, model_card=model_card).train()
