"""`instcls bench classifier` runs both modes on 2 ranks and reports consistent numbers."""

import json

from trainer.cli import main


def test_bench_reports_both_modes_and_their_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = "bench classifier --num-classes 200000 --batch 32 --dim 64 --ranks 2 --chunk-size 8192 --steps 1"
    assert main(args.split() + ["--json", str(out)]) == 0

    report = capsys.readouterr().out
    assert "dhp" in report and "replicated" in report and "DHP speed-up over replicated" in report
    summary = json.loads(out.read_text())
    dhp, replicated = summary["modes"]["dhp"], summary["modes"]["replicated"]
    assert summary["dhp_speedup"] == replicated["step_s"] / dhp["step_s"]
    assert summary["matmul_gflops_per_rank"] > 0 and dhp["gflops_per_rank"] > 0
    # W, its gradient and momentum dominate: N*D*4 bytes x 3 on each replicated rank, half that with DHP.
    assert replicated["peak_above_baseline_mib"] > 1.3 * dhp["peak_above_baseline_mib"]
    assert dhp["peak_above_baseline_mib"] > 3 * 100_000 * 64 * 4 / 2**20


def test_bench_rejects_a_batch_that_does_not_split_evenly(capsys):
    assert main("bench classifier --batch 33 --ranks 2".split()) == 2
    assert "--batch 33 must be divisible by --ranks 2" in capsys.readouterr().err
