"""`instcls bench eval` in one process: extraction images/s, the SGD probe beside scikit-learn's on the
same features, and a probe epoch's rate on synthetic rows, each measured and printed."""

import pytest

from trainer.bench.eval_bench import EvalBenchSettings, format_report, run

pytestmark = pytest.mark.integration


@pytest.mark.slow  # default suite: the probe beside scikit-learn in test_linear_probe_vs_sklearn.py
def test_the_bench_times_extraction_both_probes_and_a_probe_epoch():
    summary = run(EvalBenchSettings(rows=300, width=32, classes=5))
    assert summary["images"] == 1797 and summary["images_per_second"] > 0  # the digits, bank and held-out
    assert abs(summary["sgd_top1"] - summary["sklearn_top1"]) <= 0.02, summary  # the same features, two fits
    assert summary["synthetic"] == [300, 32, 5] and summary["synthetic_rows_per_second"] > 0
    report = format_report(summary)
    assert "sgd (8 heads, 30 epochs)" in report and "sklearn (the reference)" in report and "rows/s" in report
