"""`instcls bench checkpoint` at a tiny scale: 2 ranks save one rank's share of a 64-rank job through
the real checkpoint code (blocking and in the background) and load it back on 2 and on 3 ranks;
every load is checked value by value inside the bench, so a wrong reshard fails it."""

import json

import pytest

from trainer.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def test_bench_checkpoint_prints_the_four_figures_side_by_side(tmp_path, capsys):
    out = tmp_path / "checkpoint.json"
    assert main(["bench", "checkpoint", "--datasets", "6400", "--backbone-params", "64000", "--saves", "1",
                 "--directory", str(tmp_path / "work"), "--json", str(out)]) == 0
    report = capsys.readouterr().out
    columns = json.loads(out.read_text())["columns"]
    assert list(columns) == ["6400"]
    for classes, column in columns.items():
        assert column["rows_per_rank"] == int(classes) // 64
        saved = 2 * column["rows_per_rank"] * 128 * 2 * 4 + 64000 * 3 * 4  # rows of 2 ranks + consolidated
        assert saved < column["checkpoint_mb"] * 1e6 < saved * 1.5
        assert column["stall_ratio"] == pytest.approx(column["stall_s"] / column["sync_s"])
        assert column["preemption_margin_s"] == pytest.approx(600 - column["background_s"] - column["sync_s"])
        assert min(column["sync_s"], column["stall_s"], column["load_s"], column["reshard_load_s"]) > 0
        # The printed table shows the column's figures (the one test of format_report's text).
        for figure in (f"{column['rows_per_rank']:,}", f"{column['checkpoint_mb']:.0f} MB", f"{column['sync_s']:.2f} s",
                       f"{column['stall_s']:.3f} s", f"{column['load_s']:.2f} s", f"{column['reshard_load_s']:.2f} s",
                       f"{column['preemption_margin_s']:.0f} s"):
            assert figure in report, figure
