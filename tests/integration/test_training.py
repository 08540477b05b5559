"""End-to-end training on 2 CPU ranks: exact resume, resharding, preemption, learning."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.integration.training_helpers import (
    REPO, classifier_rows, latest_checkpoint, run_train, step_losses, train_command,
)
from data_pipeline.shards import ShardSettings, write_shards
from data_pipeline.sources import sklearn_digits

FAST = ["data.loader.batch_size=64", "optim.epochs=4", "optim.warmup_epochs=1"]


@pytest.fixture(scope="session")
def digits_split(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits_split")
    for split in ("train", "val"):
        write_shards(sklearn_digits(32, split=split), root / split, ShardSettings(prefix=split, samples_per_shard=256),
                     progress=False)
    return {"train": root / "train", "val": root / "val"}


def assert_same_training_state(a, b):
    model_a = torch.load(a / "model.pt", weights_only=True)
    model_b = torch.load(b / "model.pt", weights_only=True)
    assert model_a.keys() == model_b.keys()
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), f"backbone/head tensor {key} differs"
    rows_a, rows_b = classifier_rows(a), classifier_rows(b)
    for key in rows_a:
        assert torch.equal(rows_a[key], rows_b[key]), f"classifier {key} differs"


def test_killed_run_resumes_to_identical_parameters(digits_split, tmp_path):
    """Stop after step 8 (mid-epoch 0; 12 steps per epoch), resume to step 16 (inside epoch 1,
    after its hard-negative search) and compare with an uninterrupted run to step 16."""
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"
    run_train(interrupted, digits_split, 2, FAST + ["max_steps=8"])
    first = latest_checkpoint(interrupted)
    assert json.loads((first / "trainer.json").read_text())["step_in_epoch"] == 8
    run_train(interrupted, digits_split, 2, FAST + ["max_steps=16"], resume="auto")
    run_train(uninterrupted, digits_split, 2, FAST + ["max_steps=16"])
    resumed, reference = latest_checkpoint(interrupted), latest_checkpoint(uninterrupted)
    assert resumed.name == reference.name == "step_000000016"
    assert_same_training_state(resumed, reference)
    assert classifier_rows(resumed)["hard_negatives"].shape == (1438, 100)


def test_resharding_2_to_1_to_2_keeps_classifier_rows(digits_split, tmp_path):
    two = tmp_path / "two"
    run_train(two, digits_split, 2, FAST + ["max_steps=5"])
    original = latest_checkpoint(two)
    one = tmp_path / "one"
    run_train(one, digits_split, 1, FAST + ["max_steps=5"], resume=str(original))
    on_one = latest_checkpoint(one)
    assert json.loads((on_one / "trainer.json").read_text())["world_size"] == 1
    back = tmp_path / "back"
    run_train(back, digits_split, 2, FAST + ["max_steps=5"], resume=str(on_one))
    on_two_again = latest_checkpoint(back)
    for checkpoint in (on_one, on_two_again):
        for key, rows in classifier_rows(original).items():
            assert torch.equal(classifier_rows(checkpoint)[key], rows), f"{key} changed in {checkpoint}"


def test_sigterm_saves_a_complete_checkpoint_and_exits_zero(digits_split, tmp_path):
    # `instcls launch` is the container's entry point: torchrun that exits 0 after a clean save.
    command = train_command(tmp_path, digits_split, 2, FAST + ["optim.epochs=50", "logging.log_every=1"],
                            launcher=[sys.executable, "-m", "trainer.cli", "launch"])
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    log = tmp_path / "logs" / "rank-00000.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if log.exists() and log.read_text().count('"event": "step"') >= 3:
            break
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)  # what Kubernetes sends to the container's main process
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-4000:]
    checkpoint = latest_checkpoint(tmp_path)
    state = json.loads((checkpoint / "trainer.json").read_text())
    assert state["global_step"] >= 3 and (checkpoint / "model.pt").is_file()
    assert not list((tmp_path / "checkpoints").glob("*.tmp")), "a half-written checkpoint was left behind"
    assert "SIGTERM: saving at step" in output and "exiting 0" in output


@pytest.mark.slow
def test_training_learns_and_beats_random_init_knn(digits_split, tmp_path):
    result = run_train(tmp_path, digits_split, 2, ["eval.knn_at_end=true"], timeout=1200)
    losses = step_losses(tmp_path)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    knn = [json.loads(line) for line in (tmp_path / "logs" / "rank-00000.jsonl").read_text().splitlines()
           if '"event": "knn"' in line][0]
    assert knn["trained"] > knn["random_init"], knn
    assert "kNN accuracy (k=20, cosine, held-out split)" in result.stdout


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(digits_split, tmp_path):
    run_train(tmp_path, digits_split, 2, FAST + ["max_steps=4"])
    good = latest_checkpoint(tmp_path)
    command = train_command(tmp_path, digits_split, 2, FAST + ["optim.base_lr=1e30", "logging.log_every=1",
                                                               "checkpoint.every_steps=1"], resume="auto")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode != 0
    message = result.stderr.split("the loss or the parameters became NaN or inf by step ")[1]
    bad_step = int(message.split(";")[0])
    last_good = latest_checkpoint(tmp_path)
    assert f"Last good checkpoint: {last_good}." in message
    assert int(last_good.name.removeprefix("step_")) < bad_step  # nothing saved from the poisoned step on
    assert last_good.name >= good.name and not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_eval_commands_score_a_checkpoint(digits_split, tmp_path, capsys):
    from trainer.cli import main

    run_train(tmp_path, digits_split, 2, FAST + ["max_steps=2"])
    checkpoint = latest_checkpoint(tmp_path)
    settings = [f"data.train_shards={digits_split['train']}", f"data.eval_shards={digits_split['val']}",
                "data.loader.num_threads=2"]
    for protocol, label in (("knn", "kNN (k=20, cosine) accuracy"), ("linear", "linear probe accuracy")):
        args = ["eval", protocol, "--config", str(REPO / "configs/demo_cpu.yaml"), "--checkpoint", str(checkpoint)]
        assert main(args + [item for s in settings for item in ("--set", s)]) == 0
        out = capsys.readouterr().out
        accuracy = float(out.split(f"{label} of {checkpoint}: ")[1].split("%")[0])
        assert 20 < accuracy <= 100, out  # ten classes: far above chance even at step 2
