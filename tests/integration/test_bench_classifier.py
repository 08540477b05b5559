"""`instcls bench classifier` on 2 ranks: its measurements agree with what the settings imply."""

import json
import math

import pytest

from trainer.bench.classifier_bench import format_report
from trainer.cli import main

# The three tests read one 2-rank bench run (the module fixture): one worker runs them, so it runs once.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("bench-classifier")]

N, B, D, T = 600_000, 256, 32, 2
SHARD_BYTES = N // T * D * 4  # DHP: one rank's rows of W
FULL_BYTES = N * D * 4  # DDP: all of W on every rank
CACHE_BYTES = B * (N // T) * 4  # either mode keeps B * N / T logits per rank
MIB = 2**20


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    # One timed step after the default warm-up step: the second step is the first to hold W, its
    # gradient, the momentum and the cache at once, the peaks the tests below read.
    args = f"bench classifier --num-classes {N} --batch {B} --dim {D} --ranks {T} --chunk-size 8192 --steps 1"
    return main(args.split() + ["--json", str(out)]), json.loads(out.read_text())


def run_of(summary, mode, logits):
    (run,) = [r for r in summary["runs"] if r["mode"] == mode and r["logits"] == logits]
    return run


def test_every_run_is_timed_and_its_useful_flops_follow_the_formula(bench):
    status, summary = bench
    assert status == 0 and len(summary["runs"]) == 4
    for run in summary["runs"]:
        assert 0 < run["step_s"] < 60 and math.isfinite(run["step_s"])
        assert run["matmul_gflops_per_rank"] > 0
        # Useful work is 3 matmuls of B x D x N/T per rank, whatever the mode and the recomputation.
        assert run["useful_gflops_per_rank"] * run["step_s"] == pytest.approx(6 * B * D * N / T / 1e9, rel=1e-9)
        assert run["useful_fraction_of_matmul"] == pytest.approx(
            run["useful_gflops_per_rank"] / run["matmul_gflops_per_rank"], rel=1e-9)
    # DHP never all-reduces W's gradient; DDP all-reduces N x D floats every step.
    dhp_sync, ddp_sync = (run_of(summary, mode, "recompute")["weight_grad_sync_s"] for mode in ("dhp", "ddp"))
    assert dhp_sync < 0.1 * ddp_sync


def test_peaks_are_the_weight_state_plus_the_cache(bench):
    """W, its gradient and momentum (3 copies), the chunk workspace, and the cache when it is on."""
    _, summary = bench
    for mode, state in (("dhp", 3 * SHARD_BYTES), ("ddp", 3 * FULL_BYTES)):
        recompute = run_of(summary, mode, "recompute")["peak_above_baseline_mib"] * MIB
        cache = run_of(summary, mode, "cache")["peak_above_baseline_mib"] * MIB
        # RSS also holds what glibc keeps of freed blocks: tens of MiB either way from run to run.
        assert 0.95 * state <= recompute < 1.05 * state + 64 * MIB, (mode, recompute / MIB)
        assert cache - recompute == pytest.approx(CACHE_BYTES, rel=0.25), (mode, (cache - recompute) / MIB)
        assert run_of(summary, mode, "cache")["cache_bytes"] == CACHE_BYTES


def test_ddp_holds_about_twice_the_memory_and_the_report_shows_every_run(bench):
    _, summary = bench
    memory = summary["ddp_over_dhp_memory"]
    assert memory["recompute"] > 1.5  # 3 N D vs 3 N D / 2 floats
    # The cache is as large in both modes, so it narrows the ratio.
    expected = (3 * FULL_BYTES + CACHE_BYTES) / (3 * SHARD_BYTES + CACHE_BYTES)
    assert memory["cache"] == pytest.approx(expected, rel=0.15)
    # The report has a row per run with its figures, and the ratios (the one test of format_report's text).
    report = format_report(summary).splitlines()
    for run in summary["runs"]:
        (row,) = [line for line in report if line.split()[:3] == [run["kernel"], run["mode"], run["logits"]]]
        assert row.split()[3:5] == [f"{run['step_s']:.4f}", f"{run['weight_grad_sync_s']:.3f}"], row
        assert f"{100 * run['useful_fraction_of_matmul']:.0f}%" in row, row
    for ratios in (summary["dhp_speedup"], memory):
        assert [line for line in report if f"{ratios['recompute']:.2f}x" in line and f"{ratios['cache']:.2f}x" in line]


def test_bench_rejects_a_batch_that_does_not_split_evenly(capsys):
    assert main("bench classifier --batch 33 --ranks 2".split()) == 2
    assert "--batch 33 must be divisible by --ranks 2" in capsys.readouterr().err


@pytest.mark.slow  # default suite: the classifier bench's runs above
def test_co2_bench_times_both_losses_and_counts_the_same_collectives(tmp_path, capsys):
    out = tmp_path / "co2.json"
    args = f"bench classifier --co2 --num-classes 20000 --batch 64 --dim {D} --ranks {T} --chunk-size 1000 --steps 2"
    assert main(args.split() + ["--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    for name in ("plain", "co2"):
        assert 0 < summary["step_s"][name] < 60
    # Both all-gathers (ids, features), MAX, SUM, and the features' reduce-scatter in the backward.
    assert summary["collectives_per_step"] == {"plain": 5, "co2": 5} and summary["collectives_unchanged"]
    # A median of per-step ratios: finite, and a slowdown or speed-up of less than 100x here.
    assert math.isfinite(summary["overhead"]) and -0.99 < summary["overhead"] < 100
    # The printed report shows both step times and the overhead (the one test of its text).
    report = capsys.readouterr().out
    assert f"{summary['step_s']['plain']:.3f}" in report and f"{summary['step_s']['co2']:.3f}" in report
    assert f"{100 * summary['overhead']:+.1f}%" in report
