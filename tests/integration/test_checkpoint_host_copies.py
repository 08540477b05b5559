"""What a CPU rank's background saves keep in host memory, measured in a real training run (the
stager's copies of every tensor the save writes, and rank 0's copies for model.pt and optimizer.pt),
is what `instcls plan --cpu` counts for them."""

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.training import FAST, REPO
from trainer.config import load_job_config
from trainer.planning import checkpoint_host_copies
from trainer.planning.plan_from_config import plan_input_from_config

pytestmark = pytest.mark.integration

_TRAIN_RECORDING_SAVES = textwrap.dedent("""
    import json, sys
    import trainer
    from trainer.checkpoint import save_plan
    from tests.helpers.host_copies import kept_bytes

    stage, kept = save_plan.HostStager.stage, []

    def recording(self, plan):
        staged = stage(self, plan)
        kept.append(kept_bytes(staged))
        return staged

    save_plan.HostStager.stage = recording
    trainer.train("configs/digits_cpu.yaml", json.loads(sys.argv[1]), resume="none")
    print(json.dumps(kept))
""")


@pytest.mark.slow  # default suite: the plan's host copies in tests/unit/test_cpu_plan.py, plan vs measured
# peaks in test_planner_vs_measured.py
def test_the_cpu_plan_counts_what_background_saves_keep_in_host_memory(tiny_digits_split, tmp_path):
    # Batch 16: what a save keeps is the network, its optimizer state and the classifier rows, none of
    # which depends on the batch (the plan below reads the same overrides); the steps cost a quarter.
    overrides = FAST + ["data.loader.batch_size=16", f"data.train_shards={tiny_digits_split['train']}",
                        "data.eval_shards=null",
                        f"checkpoint.dir={tmp_path / 'checkpoints'}", f"logging.dir={tmp_path / 'logs'}",
                        "checkpoint.every_steps=1", "max_steps=3", "eval.knn_at_end=false"]
    result = subprocess.run([sys.executable, "-c", _TRAIN_RECORDING_SAVES, json.dumps(overrides)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    kept = json.loads(result.stdout.splitlines()[-1])
    assert len(kept) >= 2 and kept[-1] == kept[0], kept  # the same buffers serve every save
    plan = plan_input_from_config(load_job_config(REPO / "configs/digits_cpu.yaml", overrides), 1, 128)
    planned = checkpoint_host_copies(plan.__class__(**{**plan.__dict__, "device": "cpu"}))
    assert abs(kept[-1] / sum(planned.values()) - 1) < 0.10, (kept, planned)
