"""``optim.on_nonfinite: stop`` with an infinite gradient behind a finite loss, through the real
trainer on 2 CPU ranks.  DeepSpeed's own overflow check is off in the shipped GPU configs (it reads
the host every step); the trainer's watch (``trainer.engine.gradient_watch``) must still stop the
run naming the step, before any checkpoint holds the damaged weights.  The fail point
``train.inf_gradient`` poisons rank 1's gradient at step 3 only: at ZeRO-2 that rank's own
partition is all it sees, and the stop must still reach every rank."""

import subprocess

import pytest

from tests.helpers.training import FAST, REPO
from trainer.checkpoint.checkpoint_files import checkpoint_name
from trainer.drills.jobs import job_env, train_command

pytestmark = pytest.mark.integration


# zero2_bf16: the shipped ZeRO-2 config, DeepSpeed's checks off; zero2: fp32, where DeepSpeed's own
# check drops the step before the optimizer sees it, which must not pass without a word either
@pytest.mark.parametrize("overrides", [
    [],
    pytest.param(["deepspeed_config=ds_configs/zero2_bf16.json"], marks=pytest.mark.slow, id="zero2_bf16"),
    pytest.param(["deepspeed_config=ds_configs/zero2.json"], marks=pytest.mark.slow, id="zero2-deepspeed-drops"),
])
def test_an_infinite_gradient_behind_a_finite_loss_stops_the_run_naming_its_step(digits_split, tmp_path,
                                                                                 overrides):
    run_dir = tmp_path / "run"
    command = train_command(run_dir, digits_split, 2, FAST + overrides + [
        "logging.log_every=5", "checkpoint.every_steps=1", "checkpoint.keep_last=9", "max_steps=6"])
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env=job_env(INSTCLS_FAILPOINT="train.inf_gradient,rank=1,step=3"))
    assert result.returncode != 0, result.stderr[-3000:]
    assert "first: a backbone gradient at step 3 (behind a finite loss)" in result.stderr, result.stderr[-3000:]
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == [checkpoint_name(1), checkpoint_name(2)]  # step 3's save found the damage first
