"""SwAV with multi-crop (two crop sizes) through the real trainer under ZeRO-3 on 2 CPU ranks: the
step is one top-level engine forward, so DeepSpeed's parameter trace completes at step 2 and stays
complete (no fetch outside the recorded order invalidates it), and from step 3 on DeepSpeed reads
one value a step on the host, its overflow check.  With the crop sizes as two engine calls, the
second call restarts the trace, the backward then fails the recorded order, and every step records
again with its rank-agreement broadcasts: about 150 host reads a step at this size
(``deepspeed/runtime/zero/partitioned_param_coordinator.py``, ``zero/utils.py``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from trainer.config import load_job_config
from trainer.drills.jobs import REPO
from trainer.dry_run.host_syncs import caller
from trainer.engine.deepspeed_host_syncs import host_reads_per_step
from trainer.engine.deepspeed_setup import load_deepspeed_config
from trainer.engine.trainer import Trainer
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

STEPS = 6


class DeepSpeedValueReads:
    """Every read of a tensor's value on the host (``.item()``, ``.tolist()``, ``bool``/``int``/
    ``float``) that DeepSpeed's code makes on the training thread, with the step (``step``, set from
    outside).  The Python methods are wrapped: a 0-dim CPU tensor's ``.item()`` never reaches the
    dispatcher, so a dispatch mode would miss DeepSpeed's reads on CPU ranks."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__")

    def __init__(self) -> None:
        self.step, self.reads, self.thread = 0, [], threading.get_ident()
        self._originals = {}

    def __enter__(self):
        for name in self.METHODS:
            original = self._originals[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted(original, name))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def _counted(self, original, name):
        def read(tensor, *args, **kwargs):
            if threading.get_ident() == self.thread:
                where = caller(also_skip=(__file__,))
                if "/deepspeed/" in where:
                    self.reads.append((self.step, f"{name} at {where}"))
            return original(tensor, *args, **kwargs)
        return read


def _trace_per_step(shards: dict, run_dir: str, out: str) -> None:
    config = load_job_config(REPO / "configs" / "swav_demo_cpu.yaml", [
        f"data.train_shards={shards['train']}", "data.eval_shards=null", f"checkpoint.dir={run_dir}/checkpoints",
        f"logging.dir={run_dir}/logs", "logging.progress=false", "logging.log_every=1000", "checkpoint.every_epochs=0",
        "eval.every_epochs=0", "eval.knn_at_end=false", "deepspeed_config=ds_configs/zero3.json",
        "data.loader.batch_size=8", f"max_steps={STEPS}", "objective.num_prototypes=64"])
    dims = init_distributed()
    trainer = Trainer(config, dims)
    coordinator = trainer.engine.optimizer.parameter_offload.get_param_coordinator()
    invalidated, complete = [], []
    reads = DeepSpeedValueReads()  # on this thread: the training thread
    original_invalidate = coordinator._invalidate_trace

    def counted_invalidate():
        invalidated.append(reads.step)
        original_invalidate()

    coordinator._invalidate_trace = counted_invalidate
    def after_deepspeed_reset(module, args):  # registered after DeepSpeed's own pre-hook: runs after it
        if threading.get_ident() == reads.thread and module.training:
            reads.step += 1
            complete.append(coordinator.is_complete_trace())

    trainer.engine.module.register_forward_pre_hook(after_deepspeed_reset)
    with reads:
        trainer.train()
    if dims.rank == 0:
        Path(out).write_text(json.dumps({"complete": complete, "invalidated": invalidated, "reads": reads.reads}))


def test_a_multi_crop_swav_step_under_zero3_completes_deepspeed_s_trace_and_reads_nothing(digits_split, tmp_path):
    out = tmp_path / "trace.json"
    spawn_local_workers(_trace_per_step, 2, {k: str(v) for k, v in digits_split.items()}, str(tmp_path), str(out))
    found = json.loads(out.read_text())
    assert found["invalidated"] == [], found
    assert found["complete"][1:] == [True] * (STEPS - 1), found  # recorded in step 1, complete from step 2
    # one top-level forward a step (the objective's start-up pass would add more: SwAV has none)
    assert len(found["complete"]) == STEPS, found
    # From step 3 on DeepSpeed reads one value a step: ZeRO-3's overflow check, which has no switch
    # and which host_reads_per_step names.  Nothing of the trace's (zero/utils.py's rank agreement).
    per_step = {read.rsplit(" in ", 1)[1] for step, read in found["reads"] if 3 <= step < STEPS}
    assert per_step == {"is_invalid_grad_norm"}, found["reads"]
    assert any("ZeRO-3 checks for overflow" in rule
               for rule in host_reads_per_step(load_deepspeed_config(REPO / "ds_configs/zero3.json", micro_batch=8)))
