"""`instcls bench classifier --peer torch` on 1 and 2 ranks: both sides measured on every rank, the
ratios are their figures' ratios, and the report shows both, the ratios and the agreement."""

import json

import pytest

from trainer.cli import main

pytestmark = pytest.mark.integration


@pytest.mark.slow  # default suite: the command at T = 1 and the ranks' combination in tests/unit/test_torch_op_peer.py
def test_peer_torch_measures_both_sides_on_each_rank_and_checks_they_agree(tmp_path, capsys):
    out = tmp_path / "peer.json"
    args = ("bench classifier --peer torch --num-classes 20000 --batch 32 --dim 16 --ranks 2 --chunk-size 4096 "
            "--steps 1 --warmup 0 --cap-gib 1 --torch-settings 8,reference").split()
    assert main(args + ["--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    check = summary["agreement"]
    assert check["agree"] and check["setting"] == summary["layouts"][0]["torch"]["setting"], check
    report = capsys.readouterr().out
    assert f"vs torch's {check['setting']}" in report and "agree" in report
    assert [layout["ranks"] for layout in summary["layouts"]] == [1, 2]
    for layout in summary["layouts"]:
        ours, theirs = layout["instcls"], layout["torch"]
        # One rank: the rows updated inside instcls's backward; replicated ranks: after it, as DDP does.
        assert ours["update_in_backward"] == (layout["ranks"] == 1) and ours["status"] == "ok"
        assert [s["setting"] for s in theirs["torch_settings"]] == ["chunk 8", "reference"]
        assert theirs["setting"] in ("chunk 8", "reference") and theirs["status"] == "ok"
        assert [row["rank"] for row in layout["per_rank"]] == list(range(layout["ranks"]))
        instcls_by_rank = {r["rank"]: r for r in ours["ranks"]}
        torch_by_rank = {r["rank"]: r for r in theirs["ranks"]}
        for row in layout["per_rank"]:
            mine, other = instcls_by_rank[row["rank"]], torch_by_rank[row["rank"]]
            assert 0 < mine["step_s"] < 30 and 0 < other["step_s"] < 30
            assert row["step_ratio"] == pytest.approx(other["step_s"] / mine["step_s"])
            assert row["memory_ratio"] == pytest.approx(
                other["peak_above_baseline_bytes"] / mine["peak_above_baseline_bytes"])
            assert f"{row['step_ratio']:.2f}x" in report and f"{row['memory_ratio']:.2f}x" in report
    assert "T=2 replicated (DDP)" in report and "torch's fastest under the cap" in report
