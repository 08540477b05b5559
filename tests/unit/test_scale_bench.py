"""`instcls bench scale` runs every item at two sizes and reads growth the right way round, and
`instcls bench ingest` times the three ways in (their figures are for the README, not asserted);
PIC's per-step union is numpy's union1d, faster."""

import json

import numpy as np
import pytest

from trainer.bench.scale_bench import PER_STEP, ScaleBenchSettings, exponent, verdict, when
from trainer.cli import main
from trainer.objectives.pic.recent_ids import sorted_union

TINY = ["--num-samples", "6000", "--compare-samples", "1500", "--ranks", "4", "--batch", "8", "--new-ranks", "3",
        "--dim", "4", "--top-k", "5", "--queue-size", "64", "--samples-per-shard", "100", "--steps", "3"]


def test_bench_scale_measures_every_item_at_both_sizes(tmp_path, capsys):
    assert main(["bench", "scale", *TINY, "--json", str(tmp_path / "scale.json")]) == 0
    report = capsys.readouterr().out
    summary = json.loads((tmp_path / "scale.json").read_text())
    assert summary["steps_per_epoch"] == 6000 // 32 + 1
    small, large = summary["results"]["1500"], summary["results"]["6000"]
    assert small.keys() == large.keys() and len(large) == 11
    assert all(m["seconds"] > 0 and m["peak_mib"] >= 0 for m in [*small.values(), *large.values()])
    # Each item's row shows when it runs and the growth verdict of its two timings (the one test of
    # format_report's text).
    for item in large:
        (row,) = [line for line in report.splitlines() if line.startswith(f"| {item} |")]
        ratio = large[item]["seconds"] / small[item]["seconds"]
        assert when(item) in row and verdict(item, ratio, 6000 / 1500) in row, row
    assert "checkpoint rows re-split 4 -> 3 ranks (one rank)" in large
    assert sum(when(item) == PER_STEP for item in large) == 4


def test_growth_is_judged_by_when_an_item_runs():
    assert exponent(11.08, 11.08) == pytest.approx(1.0) and exponent(1.0, 11.08) == 0.0
    step_item, epoch_item = "hard-negative lookup of the global batch", "epoch permutation"
    assert verdict(step_item, 1.2, 11.08) == "flat"
    assert verdict(step_item, 11.0, 11.08) == "GROWS WITH N PER STEP"  # O(N) per step is what the bench catches
    assert verdict(epoch_item, 36.6, 11.08) == "<= N"  # a cache-bound O(N) permutation
    assert verdict(epoch_item, 11.08 ** 2, 11.08) == "FASTER THAN N"


def test_bench_scale_refuses_sizes_that_cannot_run():
    with pytest.raises(ValueError, match="must hold one global batch"):
        ScaleBenchSettings(num_samples=100, ranks=64, batch=64)


@pytest.mark.parametrize("sizes", [(0, 0), (5, 0), (0, 7), (300, 40), (70_000, 4096)])
def test_sorted_union_is_union1d(sizes):
    rng = np.random.default_rng(sizes)
    first, second = (rng.integers(0, 1000 if n < 1000 else 10**7, n) for n in sizes)
    assert np.array_equal(sorted_union(first, second), np.union1d(first, second))
    assert sorted_union(first, second).dtype == np.union1d(first, second).dtype


def test_bench_ingest_times_each_way_in_for_each_worker_count(tmp_path, capsys):
    assert main(["bench", "ingest", "--images", "12", "--width", "64", "--height", "48", "--workers", "1",
                 "--samples-per-shard", "5", "--json", str(tmp_path / "ingest.json")]) == 0
    rows = json.loads((tmp_path / "ingest.json").read_text())["rows"]
    assert [(row["run"], row["workers"]) for row in rows] == [
        ("folder -> shards, JPEGs kept", 1), ("folder -> shards, --max-side 256", 1), ("tars indexed in place", 1)]
    assert all(row["images_per_s"] == pytest.approx(12 / row["seconds"]) for row in rows)
    # Each row's run, workers and rate are a row of the printed table (the one test of its text).
    printed = capsys.readouterr().out.splitlines()
    for row in rows:
        (line,) = [line for line in printed if line.startswith(f"| {row['run']} |")]
        assert f"| {row['workers']} | {row['seconds']:.1f} | {row['images_per_s']:.0f} |" in line, line
