"""The SIGTERM agreement through the real trainer on 2 CPU ranks: no blocking collective of its
own in the steady state, and a SIGTERM on one rank stops both after the same step."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.helpers.training import FAST, REPO
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

SIGTERM_DURING = 4  # rank 1 gets SIGTERM during this step (1-based)


def _train(run_dir: str, shards: dict) -> None:
    import torch.distributed as real_dist

    from trainer.config import load_job_config
    from trainer.engine import stop_conditions as preemption
    from trainer.engine.trainer import Trainer
    from trainer.parallel import init_distributed

    blocking = []  # the control agreements' blocking all-reduces: who called, at which step

    class CountingDist:
        """``torch.distributed`` as the preemption module sees it, its all-reduces counted."""

        def __getattr__(self, name):
            return getattr(real_dist, name)

        def all_reduce(self, tensor, *args, async_op=False, **kwargs):
            if not async_op:
                blocking.append(sys._getframe(1).f_code.co_qualname)
            return real_dist.all_reduce(tensor, *args, async_op=async_op, **kwargs)

    preemption.dist = CountingDist()
    settings = [f"data.train_shards={shards['train']}", f"checkpoint.dir={run_dir}/checkpoints",
                f"logging.dir={run_dir}/logs", "logging.progress=false", "logging.metrics_port=0",
                "logging.log_every=1000", "eval.knn_at_end=false", "checkpoint.every_epochs=0",
                "checkpoint.every_steps=0", *FAST]
    config = load_job_config(REPO / "configs" / "digits_cpu.yaml", settings)
    dims = init_distributed()
    trainer = Trainer(config, dims, resume="none")
    step = trainer._step

    def step_with_sigterm(batch, validate):
        out = step(batch, validate)
        if dims.rank == 1 and trainer.state.global_step + 1 == SIGTERM_DURING:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets the flag
        return out

    trainer._step = step_with_sigterm
    result = trainer.train()
    Path(run_dir, f"rank-{dims.rank}.json").write_text(json.dumps(
        {"stopped_by": result.stopped_by, "step": result.state.global_step, "blocking": blocking}))


def test_sigterm_agreement_is_off_the_critical_path_and_stops_every_rank_together(digits_split, tmp_path):
    spawn_local_workers(_train, 2, str(tmp_path), digits_split)
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    for outcome in ranks:
        # Both ranks stop after the step following the signal: the agreement is read a step late.
        assert (outcome["stopped_by"], outcome["step"]) == ("sigterm", SIGTERM_DURING + 1), outcome
        # The only blocking agreements: the first step's log-step NaN check and the save's.
        assert outcome["blocking"] == ["NonFiniteWatch.check", "NonFiniteWatch.check"], outcome
