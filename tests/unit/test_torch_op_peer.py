"""instcls's classifier beside torch's ``F.linear_cross_entropy``: the same loss and gradients from
both on one problem, a comparison that sees a wrong gradient, torch's own choice of chunk, and the
order and outcome of the op's settings under a memory cap."""

import pytest
import torch
import torch.nn.functional as F

from trainer.bench.settings.torch_peer import TorchPeerSettings
from trainer.bench.torch_op import auto_batch_chunk, choices_in_memory_order, resolve
from trainer.bench.torch_op_check import (
    TOLERANCE,
    agreement,
    check_against_torch,
    instcls_results,
    torch_op_results,
)
from trainer.bench.torch_op_point import NOT_TRIED, combine_ranks, fastest
from trainer.bench.torch_op_steps import synthetic_batch
from trainer.classifier import ClassifierConfig
from trainer.cli import main
from trainer.parallel import single_process_dims

CPU = torch.device("cpu")
N, B, D = 3000, 32, 16


@pytest.fixture(scope="module")
def both_sides():
    """instcls's chunked kernel (512 rows a chunk: 6 chunks) and torch's op in chunks of 8 samples."""
    config = ClassifierConfig(num_classes=N, feature_dim=D, chunk_size=512, validate_inputs=False)
    ids, features = synthetic_batch(N, B, D, torch.float32, CPU, rank=0)
    ours = instcls_results(config, single_process_dims(CPU), ids, features)
    theirs = torch_op_results(config, resolve("8", B, N, D, torch.float32, CPU), CPU, ids, features)
    return ours, theirs


def test_instcls_and_torchs_op_give_the_same_loss_and_gradients(both_sides):
    ours, theirs = both_sides
    result = agreement(ours, theirs, TOLERANCE["float32"])
    assert result["agree"], result
    assert all(error < 1e-5 for error in result["errors"].values()), result
    # Not trivially equal: a real loss (above ln N: random cosines over tau spread the logits) and a
    # gradient in every row.
    assert theirs["loss"].item() > torch.log(torch.tensor(float(N))).item()
    assert (theirs["weight_grad"].abs().sum(dim=1) > 0).all() and (theirs["features_grad"] != 0).any()


@pytest.mark.parametrize("name", ["features_grad", "weight_grad", "loss"])
def test_the_agreement_check_fails_on_one_perturbed_quantity(both_sides, name):
    ours, theirs = both_sides
    wrong = dict(ours)
    wrong[name] = ours[name].clone()
    wrong[name].view(-1)[0] += 1e-3 * theirs[name].abs().max()  # one element off by 0.1% of the scale
    result = agreement(wrong, theirs, TOLERANCE["float32"])
    assert not result["agree"]
    assert result["errors"][name] == pytest.approx(1e-3, rel=0.2)


def test_the_bench_check_runs_both_sides_on_the_benchs_problem():
    """``check_against_torch`` (what the bench prints) agrees through the reference path too."""
    result = check_against_torch(N, B, D, "float32", 512, "reference", single_process_dims(CPU))
    assert result["agree"] and result["setting"] == "reference", result
    assert result["losses"]["instcls"] == pytest.approx(result["losses"]["torch"], rel=1e-5)


def test_auto_chunking_reads_all_rows_once_per_sample_at_one_million_classes():
    """torch's own resolution of chunking_method='auto': one row per chunk at N = 1M, B = 512, D = 128,
    so one call reads W 512 times; with few classes it picks large chunks."""
    chunk = auto_batch_chunk(512, 1_000_000, 128, torch.float32, CPU)
    assert chunk == 1
    assert resolve("auto", 512, 1_000_000, 128, torch.float32, CPU).weight_passes(512) == 512
    assert auto_batch_chunk(512, 1000, 128, torch.float32, CPU) == 64  # 512 / ceil(1000 / 128)


def test_settings_run_least_memory_first_and_a_chunk_larger_than_the_batch_is_one_chunk():
    choices = choices_in_memory_order(("reference", "512", "32", "auto", "128", "256"), 256, 1_000_000, 128,
                                      torch.float32, CPU)
    assert [c.label for c in choices] == ["auto (chunk 1)", "chunk 32", "chunk 128", "chunk 256", "reference"]
    assert [c.as_setting for c in choices] == ["auto", "32", "128", "256", "reference"]


def _rank(rank, *runs):
    return dict(rank=rank, runs=[dict(setting=s, status=status, message="" if status == "ok" else "x",
                                      step_s=step, peak_above_baseline_bytes=1) for s, status, step in runs])


def test_a_setting_fits_only_when_every_rank_ran_it_and_the_fastest_fit_wins():
    labels = ["chunk 16", "chunk 64", "reference"]
    ranks = [_rank(0, ("chunk 16", "ok", 0.5), ("chunk 64", "ok", 0.2), ("chunk 128", "peer_failed", None)),
             _rank(1, ("chunk 16", "ok", 0.7), ("chunk 64", "ok", 0.3), ("reference", "oom", None))]
    outcomes = combine_ranks(labels, ranks, world_size=2)
    assert [o["status"] for o in outcomes] == ["ok", "ok", "oom"]
    assert outcomes[0]["step_s"] == 0.7  # the worst rank
    assert fastest(outcomes)["setting"] == "chunk 64"
    one_rank_short = combine_ranks(labels, ranks[:1], world_size=2)
    assert [o["status"] for o in one_rank_short] == ["failed", "failed", NOT_TRIED]
    assert fastest(one_rank_short) is None


def test_peer_torch_without_the_op_names_the_installed_torch(monkeypatch, capsys):
    monkeypatch.delattr(F, "linear_cross_entropy")
    assert main("bench classifier --peer torch --num-classes 100 --batch 8 --ranks 1".split()) == 2
    error = capsys.readouterr().err
    assert f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy" in error, error


def test_torch_settings_must_be_named_settings_or_chunk_sizes():
    with pytest.raises(ValueError, match="--torch-settings: .*not 0,big"):
        TorchPeerSettings(torch_settings=("reference", "0", "big"))
