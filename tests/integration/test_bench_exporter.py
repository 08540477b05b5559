"""`instcls bench exporter` measures quiet and scraped windows side by side and reports their ratio."""

import json

import pytest

from trainer.cli import main

pytestmark = pytest.mark.integration


@pytest.mark.slow  # default suite: the exporter's bounded rate (tests/unit/test_exporter.py)
def test_bench_exporter_reports_each_round_and_the_cost(tmp_path, capsys):
    out = tmp_path / "exporter.json"
    assert main(["bench", "exporter", "--seconds", "1", "--rounds", "2", "--scrapers", "4", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert len(summary["quiet_steps_per_s"]) == len(summary["loaded_steps_per_s"]) == 2
    for quiet, loaded, ratio in zip(summary["quiet_steps_per_s"], summary["loaded_steps_per_s"],
                                    summary["loaded_over_quiet"]):
        assert quiet > 0 and loaded > 0 and ratio == pytest.approx(loaded / quiet)
    assert summary["overhead_percent"] == pytest.approx(100 * (1 - sum(summary["loaded_over_quiet"]) / 2))
    assert summary["scrapes_per_s"] > 0
    assert summary["settings"]["scrapers"] == 4
    # The printed report has a row per round with its figures, and the cost (the one test of its text).
    report = capsys.readouterr().out.splitlines()
    for number, (quiet, loaded, ratio) in enumerate(zip(summary["quiet_steps_per_s"], summary["loaded_steps_per_s"],
                                                        summary["loaded_over_quiet"]), start=1):
        assert [str(number), f"{quiet:.2f}", f"{loaded:.2f}", f"{ratio:.3f}"] in [line.split() for line in report]
    assert [line for line in report if f"{summary['overhead_percent']:.2f}%" in line]
