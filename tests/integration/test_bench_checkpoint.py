"""`instcls bench checkpoint` at a tiny scale: 2 ranks save one rank's share of a 64-rank job through
the real checkpoint code (blocking and in the background) and load it back on 2 and on 3 ranks;
every load is checked value by value inside the bench, so a wrong reshard fails it."""

import json

import pytest

from trainer.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_bench_checkpoint_prints_the_four_figures_side_by_side(tmp_path, capsys):
    out = tmp_path / "checkpoint.json"
    assert main(["bench", "checkpoint", "--datasets", "6400", "--backbone-params", "64000", "--saves", "1",
                 "--directory", str(tmp_path / "work"), "--json", str(out)]) == 0
    report = capsys.readouterr().out
    for label in ("synchronous save", "async save: the step's stall", "load on 2 ranks (as saved)",
                  "load onto 3 ranks (resharded)", "margin within a 600 s grace period"):
        assert label in report
    assert "N=6400 / 64" in report
    columns = json.loads(out.read_text())["columns"]
    for classes, column in columns.items():
        assert column["rows_per_rank"] == int(classes) // 64
        saved = 2 * column["rows_per_rank"] * 128 * 2 * 4 + 64000 * 3 * 4  # rows of 2 ranks + consolidated
        assert saved < column["checkpoint_mb"] * 1e6 < saved * 1.5
        assert column["stall_ratio"] == pytest.approx(column["stall_s"] / column["sync_s"])
        assert column["preemption_margin_s"] == pytest.approx(600 - column["background_s"] - column["sync_s"])
        assert min(column["sync_s"], column["stall_s"], column["load_s"], column["reshard_load_s"]) > 0
