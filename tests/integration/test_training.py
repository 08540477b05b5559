"""End-to-end training on 2 CPU ranks: exact resume, resharding, a NaN stop, learning (preemption:
the SIGTERM drill in test_drills.py)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.training import (
    FAST,
    REPO,
    classifier_rows,
    latest_checkpoint,
    replica_checks,
    run_train,
    step_losses,
    train_command,
)
from trainer.checkpoint.checkpoint_files import read_trainer_meta
from trainer.drills.jobs import TORCHRUN
from trainer.exit_codes import ExitCode
from trainer.observability.report import RunLogs
from trainer.parallel.launch import free_port

pytestmark = pytest.mark.integration


def assert_same_training_state(a, b):
    model_a = torch.load(a / "model.pt", weights_only=True)
    model_b = torch.load(b / "model.pt", weights_only=True)
    assert model_a.keys() == model_b.keys()
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), f"backbone/head tensor {key} differs"
    rows_a, rows_b = classifier_rows(a), classifier_rows(b)
    for key in rows_a:
        assert torch.equal(rows_a[key], rows_b[key]), f"classifier {key} differs"


@pytest.mark.slow  # default suite: the preempted-with-sigterm and rank-killed-mid-step drills resume bit-identically
def test_killed_run_resumes_to_identical_parameters(digits_split, tmp_path, monkeypatch):
    """Stop after step 8 (mid-epoch 0; 12 steps per epoch), resume to step 16 (inside epoch 1,
    after its hard-negative search) and compare with an uninterrupted run to step 16.  No C++
    extension is compiled on the way (DeepSpeed's CPU shared-memory op included): a run-time build
    depends on the machine's compiler and cache, and costs every new pod up to a minute."""
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"
    extensions = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    run_train(interrupted, digits_split, 2, FAST + ["max_steps=8"])
    assert not extensions.exists() or not any(extensions.rglob("*.so")), sorted(extensions.rglob("*"))
    first = latest_checkpoint(interrupted)
    assert json.loads((first / "trainer.json").read_text())["step_in_epoch"] == 8
    run_train(interrupted, digits_split, 2, FAST + ["max_steps=16"], resume="auto")
    run_train(uninterrupted, digits_split, 2, FAST + ["max_steps=16"])
    resumed, reference = latest_checkpoint(interrupted), latest_checkpoint(uninterrupted)
    assert resumed.name == reference.name == "step_000000016"
    assert_same_training_state(resumed, reference)
    assert classifier_rows(resumed)["hard_negatives"].shape == (1438, 100)


def _compare_updates(a: torch.Tensor, b: torch.Tensor, start: torch.Tensor) -> tuple[float, float]:
    """``(gap, cosine)`` of two continuations of ``start``: how far apart they end relative to how
    far they moved, and whether they moved the same way."""
    moved_a, moved_b = (a - start).flatten(), (b - start).flatten()
    gap = (moved_a - moved_b).norm() / moved_b.norm()
    return float(gap), float(moved_a @ moved_b / (moved_a.norm() * moved_b.norm()))


@pytest.mark.slow  # exact per part in the default suite: test_objective_reshard, test_backbone_optimizer_reshard[2]
def test_resharding_2_to_1_to_2_continues_the_same_training(digits_split, tmp_path):
    """Stop on 2 ranks mid-epoch, run 3 steps on 1 rank, then 3 more back on 2 ranks, with the same
    global batch (2 x 64 = 1 x 128); compare with the same 6 steps never resharded.  The sampler
    gives the same global batches whatever the world size, and row-sharded state is re-split by
    row range (exactly: ``test_objective_reshard.py``), and the backbone's optimizer state too
    (exactly: ``test_backbone_optimizer_reshard.py``).  Here the backbone differs by BatchNorm's
    per-rank batch statistics (64 vs 128 images).  So the classifier must move the
    same way (gap < 1, cosine > 0.6), hard negatives stay identical, and rows put back in
    the wrong place would move by their whole norm (gap >> 1, cosine ~ 0)."""
    two_ranks, one_rank = FAST, [*FAST, "data.loader.batch_size=128"]
    start = tmp_path / "start"
    run_train(start, digits_split, 2, two_ranks + ["max_steps=5"])
    original = latest_checkpoint(start)
    resharded, reference = tmp_path / "resharded", tmp_path / "reference"
    run_train(resharded, digits_split, 1, one_rank + ["max_steps=8"], resume=str(original))
    run_train(reference, digits_split, 2, two_ranks + ["max_steps=8"], resume=str(original))
    on_one, reference_8 = latest_checkpoint(resharded), latest_checkpoint(reference)
    assert json.loads((on_one / "trainer.json").read_text())["world_size"] == 1
    run_train(resharded, digits_split, 2, two_ranks + ["max_steps=11"], resume=str(on_one))
    run_train(reference, digits_split, 2, two_ranks + ["max_steps=11"], resume=str(reference_8))
    back_on_two, reference_11 = latest_checkpoint(resharded), latest_checkpoint(reference)
    assert back_on_two.name == reference_11.name == "step_000000011"

    rows = {
        name: classifier_rows(path)
        for name, path in (
            ("start", original),
            ("one", on_one),
            ("ref8", reference_8),
            ("two", back_on_two),
            ("ref11", reference_11),
        )
    }
    for mine, theirs in (("one", "ref8"), ("two", "ref11")):
        assert torch.equal(rows[mine]["hard_negatives"], rows["start"]["hard_negatives"])
        for key in ("weight", "momentum"):
            gap, cosine = _compare_updates(rows[mine][key], rows[theirs][key], rows["start"][key])
            assert gap < 1 and cosine > 0.6, f"{key} after resharding ({mine}): gap {gap:.3f}, cosine {cosine:.3f}"


# default suite: the kernel's in-backward update and logits cache against the float64 reference
# and torch SGD (tests/unit/test_kernel.py); this is the trainer's wiring of both options
@pytest.mark.slow
def test_in_backward_update_and_logits_cache_train_like_the_plain_step(digits_split, tmp_path):
    """What `instcls plan` predicts, the trainer runs: W updated chunk by chunk inside the backward
    (no full gradient) and the forward's logits cached for the backward give the same training as
    the plain step, up to float rounding.  Two steps: this small-batch BatchNorm network amplifies
    rounding chaotically after that (measured: a chunk size of 256 instead of 4096, which changes
    nothing but rounding, moves the backbone by 6e-3 at step 3 while rows agree to 1e-7 at step 2)."""
    settings = {
        "plain": [],
        "in_backward": ["objective.update_in_backward=true"],
        "cached": ["objective.logits_cache_bytes=100000000"],
    }
    rows = {}
    for name, extra in settings.items():
        run_train(tmp_path / name, digits_split, 2, FAST + ["max_steps=2", *extra])
        rows[name] = classifier_rows(latest_checkpoint(tmp_path / name))
    assert rows["plain"]["momentum"].abs().sum() > 0, "no step was taken"
    for name in ("in_backward", "cached"):
        for key in ("weight", "momentum"):
            torch.testing.assert_close(rows[name][key], rows["plain"][key], atol=1e-6, rtol=0, msg=f"{name} {key}")


def _assert_evaluated_on_schedule_and_summarised(run_dir, result, epochs: int, every: int, steps_per_epoch: int = 12,
                                                 local_batch: int = 64) -> dict:
    """kNN every ``every`` epochs against one random-init baseline, the linear probe and its
    learning curve at the end, a summary per rank, and the final line printed; the final eval.
    The defaults are the digits' 1,438 training images in global batches of 2 x 64."""
    records = [json.loads(line) for line in (run_dir / "logs" / "rank-00000.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["event"] == "eval"]
    expected = [(epoch, epoch == epochs) for epoch in range(every, epochs + 1, every)]
    assert [(r["epoch"], r["final"]) for r in evals] == expected, evals
    final = evals[-1]
    assert {r["knn_random_init"] for r in evals} == {final["knn_random_init"]}  # one baseline, scored once
    assert "linear_trained" not in evals[0] and 0.5 < final["linear_trained"] <= 1.0
    assert sorted(final["linear_curve"], key=float) == ["0.1", "0.25", "0.5", "1.0"]
    assert final["linear_curve"]["1.0"] == final["linear_trained"]  # the full-label point is the probe itself
    summaries = [
        json.loads(line)
        for rank in (0, 1)
        for line in (run_dir / "logs" / f"rank-{rank:05d}.jsonl").read_text().splitlines()
        if '"summary"' in line
    ]
    steps = steps_per_epoch * epochs
    assert [(s["epochs"], s["steps"], s["images"]) for s in summaries] == [(epochs, steps, steps * local_batch)] * 2, \
        summaries
    assert all(s["peak_memory_bytes"] > 100 << 20 for s in summaries)  # a ResNet-18 rank holds >100 MiB
    # The final evaluation is printed with its figures (the one test of that line's text).
    figures = [f"{100 * final[key]:.2f}%" for key in ("knn_trained", "knn_random_init", "linear_trained",
                                                       "linear_random_init")]
    assert [line for line in result.stdout.splitlines() if all(f in line for f in figures)], result.stdout[-3000:]
    return final


# A short run with every evaluation (128 digits: 2 steps an epoch), on disk; the S3 test trains it again
# from a bucket and compares (both in the "s3" group, so that one worker trains this reference once).
TINY_EVALUATED = ["data.loader.batch_size=32", "logging.log_every=1", "optim.epochs=3", "eval.knn_at_end=true",
                  "eval.every_epochs=1", "eval.linear_at_end=true", "logging.progress=true",
                  "logging.progress_every_s=0"]


@pytest.fixture(scope="module")
def tiny_evaluated_run(tiny_digits_split, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiny-evaluated")
    return run_dir, run_train(run_dir, tiny_digits_split, 2, TINY_EVALUATED)


def _scores(result) -> list[str]:
    """The evaluation lines a run printed, without their timings."""
    return [re.sub(r" \(\d+\.\d s\)$", "", line) for line in result.stdout.splitlines()
            if "accuracy" in line and "%" in line]


@pytest.mark.xdist_group("s3")
def test_training_evaluates_on_schedule_and_summarises(tiny_evaluated_run):
    """The evaluation schedule and the run's summaries in a short run (128 digits: 2 steps an epoch);
    whether it learns is held by the slow tests below and on the digit scenes."""
    tmp_path, result = tiny_evaluated_run
    _assert_evaluated_on_schedule_and_summarised(tmp_path, result, epochs=3, every=1, steps_per_epoch=2, local_batch=32)
    # the final checkpoint records the run's end, so that a resume of it neither trains nor evaluates
    assert read_trainer_meta(latest_checkpoint(tmp_path))["run_end"] == {"finished": True, "evaluation": "done"}
    # Output to a pipe, as in a pod log: plain progress lines, one per log step, no carriage returns,
    # and none of the warnings every run used to print.
    output = result.stdout + result.stderr
    assert "\r" not in output
    progress = [line for line in result.stdout.splitlines() if re.match(r"\[instcls\] epoch \d+ step \d+/2 ", line)]
    logged = [
        json.loads(line)
        for line in (tmp_path / "logs" / "rank-00000.jsonl").read_text().splitlines()
        if '"event": "step"' in line
    ]
    assert [int(re.search(r"\(run (\d+)/6\)", line)[1]) for line in progress] == [r["step"] for r in logged]
    assert len(logged) == 6
    # the line prints the loss to 4 decimals, the log keeps 5: both rounded from the same value
    shown = [float(re.search(r"\| loss (\S+) \|", line)[1]) for line in progress]
    assert all(abs(value - r["loss"]) <= 0.5e-4 + 0.5e-5 + 1e-9 for value, r in zip(shown, logged)), (shown, logged)
    assert "Warning" not in output and "Setting accelerator" not in output, output[-3000:]


@pytest.mark.slow
def test_training_learns_and_beats_random_init_knn(digits_split, tmp_path):
    """On the 8x8 digits a random network already scores ~93-95% kNN; 15 epochs beat it by +4.5,
    +2.5 and +2.5 points (seeds 0-2, measured on one machine; 9 to 16 of 359 held-out images), so
    the floor is "above", one image.  The wide-margin learning floors are on the digit scenes
    (test_demo.py, test_swav_training.py).  Slow: two minutes, most of `make test`'s longest case."""
    result = run_train(
        tmp_path,
        digits_split,
        2,
        ["eval.knn_at_end=true", "eval.every_epochs=5", "eval.linear_at_end=true"],
        timeout=900,
    )
    losses = step_losses(tmp_path)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    final = _assert_evaluated_on_schedule_and_summarised(tmp_path, result, epochs=15, every=5)
    assert final["knn_trained"] > final["knn_random_init"], final


@pytest.mark.slow  # default suite: a non-finite run stops naming its step in test_nonfinite_gradient.py
def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(digits_split, tmp_path):
    """Under `instcls launch`, the container's entry point, the job exits with the permanent code of a
    poisoned model (torchrun alone would say 1, as for any crash): Kubernetes must not retry it."""
    run_train(tmp_path, digits_split, 2, FAST + ["max_steps=4"])
    good = latest_checkpoint(tmp_path)
    command = train_command(
        tmp_path,
        digits_split,
        2,
        FAST + ["optim.base_lr=1e30", "logging.log_every=1", "checkpoint.every_steps=1"],
        resume="auto",
        launcher=[sys.executable, "-m", "trainer.cli", "launch"],
    )
    result = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert result.returncode == ExitCode.NONFINITE_LOSS, result.stderr[-3000:]
    message = result.stderr.split("the loss or the parameters became NaN or inf by step ")[1]
    bad_step = int(message.split(";")[0])
    last_good = latest_checkpoint(tmp_path)
    assert f"Last good checkpoint: {last_good}." in message
    assert int(last_good.name.removeprefix("step_")) < bad_step  # nothing saved from the poisoned step on
    assert last_good.name >= good.name and not list((tmp_path / "checkpoints").glob("*.tmp"))


def knn_neighbour_ids(bank: torch.Tensor, queries: torch.Tensor, k: int) -> torch.Tensor:
    """Each query's k most cosine-similar bank rows, as sorted row numbers ``[q, k]`` (a set per row)."""
    similarities = F.normalize(queries.double(), dim=1) @ F.normalize(bank.double(), dim=1).t()
    return similarities.topk(k, dim=1).indices.sort(dim=1).values


def _eval_command(protocol: str, checkpoint, settings: list[str], features_out=None, nproc: int | None = None):
    args = ["eval", protocol, "--config", str(REPO / "configs/digits_cpu.yaml"), "--checkpoint", str(checkpoint)]
    args += [item for s in settings for item in ("--set", s)]
    args += ["--features-out", str(features_out)] if features_out else []
    if nproc is None:
        return args
    return [*TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "-m", "trainer.cli", *args]


def _printed(out: str, name) -> tuple[float, str]:
    """(accuracy in [0, 1], held-out features digest) of `instcls eval`'s line about ``name``."""
    found = re.search(
        rf"accuracy of {re.escape(str(name))}: [0-9.]+% \(([0-9.e-]+); held-out features digest "
        r"([0-9a-f]{16})\)",
        out,
    )
    assert found, out
    return float(found.group(1)), found.group(2)


@pytest.fixture(scope="module")
def evaluated_run(digits_split, tmp_path_factory):
    """A 2-rank run with per-rank BatchNorm (model.batch_norm: local) that scored kNN at its end, run
    from a folder outside the checkout with a copied config (its ds_configs/zero0.json is the
    shipped file): (run folder, its last checkpoint, the trainer's last eval record)."""
    run_dir = tmp_path_factory.mktemp("evaluated-run")
    copied = run_dir / "my-job.yaml"
    copied.write_text((REPO / "configs/digits_cpu.yaml").read_text())
    run_train(run_dir, digits_split, 2, FAST + ["optim.epochs=2", "eval.knn_at_end=true", "eval.linear_at_end=true",
                                                "eval.linear.method=sgd"], config=str(copied), cwd=run_dir)
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint.name == "step_000000024"  # 2 epochs of 12 steps
    return run_dir, checkpoint, RunLogs.read(run_dir / "logs").last("eval")


def _eval_settings(digits_split) -> list[str]:
    return [f"data.train_shards={digits_split['train']}", f"data.eval_shards={digits_split['val']}",
            "data.loader.num_threads=1", "eval.linear.method=sgd"]


def _eval_on_two_ranks(name, digits_split, out_dir, protocol="knn") -> tuple[tuple[float, str], object]:
    """`instcls eval knn` (or ``protocol``) of ``name`` (a checkpoint or "random-init") under torchrun on 2
    ranks, with the trainer's loader, batch size and threads: what it printed, and the features it wrote."""
    out = out_dir / f"features-2-ranks-{protocol}-{getattr(name, 'name', name)}.pt"
    result = subprocess.run(_eval_command(protocol, name, _eval_settings(digits_split), out, nproc=2), cwd=out_dir,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "\r" not in result.stdout + result.stderr, result.stderr[-3000:]
    return _printed(result.stdout, name), torch.load(out, weights_only=True)


@pytest.mark.slow  # default suite: `instcls eval` scores PIC's checkpoint in test_pic_training.py
def test_eval_scores_a_checkpoint_exactly_as_the_trainer_did(evaluated_run, digits_split, tmp_path, capsys):
    """One network, one score.  The ranks' BatchNorm running statistics drift apart; before each save
    and evaluation the trainer averages them into the network that model.pt holds and every rank
    scores, and every state the ranks should hold alike is compared across ranks and logged.  Then
    `instcls eval` on the checkpoint, with the same loader, batch size, threads and ranks, scores
    bit-identical held-out features (the same digest) and exactly the trainer's kNN.  A checkpoint of
    another network is refused in one sentence naming the difference, before any tensor is read."""
    from trainer.cli import main

    run_dir, checkpoint, logged = evaluated_run
    for checks in replica_checks(run_dir, 2):
        assert [(c["moment"], c["step"], c["entries"] > 100) for c in checks] == [("save", 24, True)]  # eval: same step
        # the ranks' statistics had drifted apart: without the averaging they would differ
        assert checks[0]["batch_norm_spread"] > 1e-3, checks
    # model.pt holds the average of the ranks' own statistics, which each rank keeps for itself
    per_rank = [torch.load(checkpoint / "batch_norm" / f"rank-{r:05d}.pt", weights_only=True) for r in (0, 1)]
    saved = torch.load(checkpoint / "model.pt", weights_only=True)
    assert len(per_rank[0]) > 10 and not all(torch.equal(per_rank[0][k], per_rank[1][k]) for k in per_rank[0])
    for name in per_rank[0]:
        torch.testing.assert_close(saved[name], (per_rank[0][name] + per_rank[1][name]) / 2, rtol=1e-6, atol=1e-6)
    printed, _ = _eval_on_two_ranks(checkpoint, digits_split, tmp_path)
    assert printed == (logged["knn_trained"], logged["query_features_digest"]), (printed, logged)
    # the linear probe too: the data-parallel probe of `instcls eval linear` is the trainer's
    printed, _ = _eval_on_two_ranks(checkpoint, digits_split, tmp_path, protocol="linear")
    assert logged["linear_method"] == "sgd" and printed[0] == logged["linear_trained"], (printed, logged)

    other = ["--set", "model.arch=resnet10", "--set", "model.feature_dim=64"]
    files = {p: p.stat().st_mtime_ns for p in checkpoint.rglob("*")}
    assert main(_eval_command("knn", checkpoint, _eval_settings(digits_split)) + other) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "model.arch is 'resnet18' there and 'resnet10' here" in said[0], said
    assert "model.feature_dim is 128 there and 64 here" in said[0] and "objective" not in said[0]
    assert files == {p: p.stat().st_mtime_ns for p in checkpoint.rglob("*")}


@pytest.mark.slow  # the default suite holds the same checkpoint's 2-rank score and the refusal above
def test_eval_in_one_process_and_of_the_random_init_agree_with_the_trainer(evaluated_run, digits_split, tmp_path,
                                                                           capsys):
    """The random-init baseline scores on 2 ranks exactly as the trainer's; in one process with
    torch's default threads the features agree within float32 rounding and every query's kNN
    neighbour set is the same; the linear probe scores; a resume with another network is refused in
    one sentence and leaves the checkpoint as it was."""
    from trainer.cli import main

    run_dir, checkpoint, logged = evaluated_run
    printed, _ = _eval_on_two_ranks("random-init", digits_split, tmp_path)
    assert printed[0] == logged["knn_random_init"], (printed, logged)

    _, two = _eval_on_two_ranks(checkpoint, digits_split, tmp_path)
    one_process = tmp_path / "features-1-process.pt"
    assert main(_eval_command("knn", checkpoint, _eval_settings(digits_split), one_process)) == 0
    accuracy, _ = _printed(capsys.readouterr().out, checkpoint)
    one = torch.load(one_process, weights_only=True)
    for part in ("bank", "queries"):
        assert torch.equal(one[part]["ids"], two[part]["ids"]) and torch.equal(one[part]["labels"], two[part]["labels"])
        torch.testing.assert_close(one[part]["features"], two[part]["features"], rtol=1e-4, atol=1e-5)
    neighbours = [knn_neighbour_ids(f["bank"]["features"], f["queries"]["features"], 20) for f in (one, two)]
    assert torch.equal(*neighbours)
    assert accuracy == logged["knn_trained"]
    assert main(_eval_command("linear", checkpoint, _eval_settings(digits_split))) == 0
    assert 0.5 < _printed(capsys.readouterr().out, checkpoint)[0] <= 1

    files = {p: p.stat().st_mtime_ns for p in checkpoint.rglob("*")}
    command = train_command(run_dir, digits_split, 2, FAST + ["optim.epochs=2", "model.arch=resnet10"], resume="auto")
    result = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert result.returncode != 0
    assert (
        f"checkpoint {checkpoint} was trained with another job: model.arch is 'resnet18' there and "
        "'resnet10' here. Resume it with the config" in result.stderr
    ), result.stderr[-3000:]
    assert "Unexpected key" not in result.stderr and files == {p: p.stat().st_mtime_ns for p in checkpoint.rglob("*")}


@pytest.mark.xdist_group("s3")
def test_the_same_run_from_s3_gives_the_same_losses_and_scores(tiny_evaluated_run, tiny_digits_split, s3_server,
                                                               tmp_path, monkeypatch):
    """The training, held-out and kNN bank sets in a bucket of a real S3 server (SeaweedFS): the same
    losses step for step and the same evaluations as from disk, because the samples, their views and
    their order do not depend on where the bytes come from; the run records the same manifest digest."""
    remote = {split: f"s3://instcls-train/digits/{split}" for split in ("train", "val")}
    for split, url in remote.items():
        s3_server.sync_up(tiny_digits_split[split], url)
    for name, value in s3_server.client_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("INSTCLS_TABLE_CACHE", str(tmp_path / "table-cache"))
    from_s3 = run_train(tmp_path, remote, 2, [*TINY_EVALUATED, "data.storage.max_in_flight=8"])
    disk_dir, from_disk = tiny_evaluated_run
    losses = step_losses(tmp_path)
    assert len(losses) == 6 and losses == step_losses(disk_dir)
    assert len(_scores(from_s3)) == 3 and _scores(from_s3) == _scores(from_disk)  # after epochs 1, 2 and 3
    recorded = [json.loads((latest_checkpoint(run) / "run.json").read_text())["train_manifest"]
                for run in (tmp_path, disk_dir)]
    assert recorded[0]["digest"] == recorded[1]["digest"] and recorded[0]["path"] == remote["train"]
    # one table download per node and set, shared by both ranks: the training and the held-out set's
    assert len(list((tmp_path / "table-cache").glob("*.npy"))) == 2
