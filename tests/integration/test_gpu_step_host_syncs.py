"""On a GPU: a training step of each shipped ResNet-50 bf16 config makes the training thread wait for
the device 0 times outside log steps (the host keeps queueing ahead of the device), over steps 3 to
6.  Counted: every call CUDA's sync-debug mode warns on, and the waits it does not report
(``torch.cuda.synchronize``, stream and event ``synchronize``, DeepSpeed's accelerator's), on the
training thread only (``device_sync_sites``).  DeepSpeed's per-step reads and its throughput timer
are off in those configs (``trainer.engine.deepspeed_host_syncs``), BatchNorm synchronises without a
host read (``trainer.parallel.sync_batch_norm``), and the non-finite checks are flags on the device
read on log steps only.  The loader is DALI where it is installed, else the torch fallback (a lent GPU
machine has no DALI): the test prints which.  On one GPU the multi-rank branches run over a group of
one (``parallel.collectives_over_one_rank``): SyncBatchNorm's synchronised path and the device skip's
all-reduce.  On CPU ranks the DeepSpeed part is held by
``tests/integration/test_deepspeed_device_waits.py`` and ``test_deepspeed_host_syncs.py``."""

import importlib.util
from pathlib import Path

import pytest

from trainer.bench.step_bench import StepBenchSettings, run

pytestmark = [pytest.mark.integration, pytest.mark.gpu]

REPO = Path(__file__).resolve().parents[2]
BACKEND = "dali" if importlib.util.find_spec("nvidia.dali") else "torch"


@pytest.mark.parametrize("job", ["in1k_r50_64gpu", "in21k_r50_64gpu", "pic_in1k_r50", "swav_in1k_r50"])
def test_a_step_of_each_shipped_resnet50_config_syncs_nothing_outside_log_steps(job):
    print(f"loader backend: {BACKEND}")
    settings = StepBenchSettings(config=REPO / "configs" / f"{job}.yaml", ranks=1, steps=4, warmup=2)
    result = run(settings, ["data.loader.batch_size=32", "logging.log_every=1000",  # no log step is measured
                            f"data.loader.backend={BACKEND}",
                            # one GPU runs what several ranks run: SyncBatchNorm's synchronised path
                            # (its fused kernels), the device skip's all-reduce
                            "parallel.collectives_over_one_rank=true"])
    (rank,) = result["ranks"]
    assert rank["host_syncs_per_step"] == 0, rank["host_sync_sites_per_step"]
