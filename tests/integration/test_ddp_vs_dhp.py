"""`bench ddp-vs-dhp` finds both limits and writes its report; `plan` predicts what it measures."""

import csv
import json

import pytest
from PIL import Image

from trainer.bench.ddp_vs_dhp import SweepSettings, run_point
from trainer.bench.planner import PlanInput, total
from trainer.cli import main


def test_sweep_finds_both_limits_and_writes_table_csv_and_plot(tmp_path, capsys):
    out = tmp_path / "report"
    args = ("bench ddp-vs-dhp --ranks 2 --batch 32 --dim 64 --chunk-size 4096 --cap-gib 0.08 "
            f"--start-classes 40000 --refine-steps 2 --out {out}").split()
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    ddp, dhp = summary["largest_classes"]["ddp"], summary["largest_classes"]["dhp"]
    assert ddp and dhp and dhp > 1.5 * ddp, summary["largest_classes"]
    rows = list(csv.DictReader(open(out / "points.csv")))
    assert {r["status"] for r in rows} >= {"ok", "oom"}, "the sweep must end in a real allocation failure"
    assert all(float(r["compute_s"]) > 0 and float(r["comm_s"]) >= 0 for r in rows if r["status"] == "ok")
    table = (out / "table.md").read_text()
    assert f"| DDP (replicated W) | {ddp:,} |" in table and f"| DHP (sharded W) | {dhp:,} |" in table
    assert "(the largest both train)" in table
    assert Image.open(out / "memory.png").size[0] > 400
    assert "DHP trains" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["ddp", "dhp"])
def test_plan_predicts_measured_peak_within_15_percent(mode):
    settings = SweepSettings(ranks=2, batch=64, dim=128, chunk_size=8192, cap_gib=4.0)
    for num_classes in (60_000, 250_000):
        point = run_point(settings, mode, num_classes)
        assert point["status"] == "ok", point
        predicted = total(PlanInput(mode=mode, num_classes=num_classes, ranks=2, batch=64, dim=128, chunk_size=8192,
                                    views=1, device="cpu"))
        for rank in point["ranks"]:
            measured = rank["peak_above_baseline_bytes"]
            assert abs(measured - predicted) / measured < 0.15, (mode, num_classes, measured, predicted)
