"""`instcls bench data` measures both loaders on the same shards, with and without multi-crop, and
reports their ratios."""

import json

import pytest

from trainer.cli import main

pytestmark = pytest.mark.integration


def test_bench_data_reports_both_loaders_with_and_without_multicrop(digits_shards, tmp_path, capsys):
    args = f"bench data --shards {digits_shards} --crop-size 32 --batch 32 --batches 3 --warmup 1"
    assert main(args.split() + ["--json", str(tmp_path / "data.json")]) == 0
    summary = json.loads((tmp_path / "data.json").read_text())
    rows = {row["views"]: row for row in summary["recipes"]}
    assert list(rows) == ["2 x 32px", "2 x 32px + 6 x 13px"], summary
    for row in rows.values():
        assert row["dali_images_per_s"] > 0 and row["torch_images_per_s"] > 0
        assert row["dali_over_torch"] == pytest.approx(row["dali_images_per_s"] / row["torch_images_per_s"])
    # A row per recipe with both loaders' images/s and their ratio, then multi-crop over the plain
    # recipe (the one test of format_report's text).
    out = capsys.readouterr().out.splitlines()
    for views, row in rows.items():
        figures = [f"{row['dali_images_per_s']:.1f}", f"{row['torch_images_per_s']:.1f}",
                   f"{row['dali_over_torch']:.2f}x"]
        assert figures in [line[len(views):].split() for line in out if line.startswith(views + " ")], views
    plain, multicrop = rows.values()
    assert [line for line in out if f"{multicrop['dali_images_per_s'] / plain['dali_images_per_s']:.2f}x" in line
            and f"{multicrop['torch_images_per_s'] / plain['torch_images_per_s']:.2f}x" in line]
