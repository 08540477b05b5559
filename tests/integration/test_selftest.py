"""`instcls selftest`: its CPU subset passes here and in CI and names what it skipped; a failing
check fails the command; on a GPU node (marker ``gpu``) every check must run and pass."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.training import REPO
from trainer.selftest.report import FAIL, PASS, SKIPPED, CheckResult

GPU_ONLY = {"host syncs per step", "bf16 ZeRO-2 ResNet-50 step"}
EVERY_CHECK = {"devices", "compiled CO2 kernel", "PIC host store + prefetch", "DALI decode", "collectives",
               "sharded classifier"} | GPU_ONLY


def test_the_cpu_subset_passes_and_says_what_it_skipped(tmp_path):
    out = tmp_path / "selftest.json"
    result = subprocess.run([sys.executable, "-m", "trainer.cli", "selftest", "--json", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())}
    assert set(rows) == EVERY_CHECK
    for name, row in rows.items():
        if name in GPU_ONLY:
            assert row["status"] == SKIPPED and "CUDA" in row["detail"], row
        else:
            assert row["status"] == PASS, row
    assert "sharded classifier" in result.stdout and "skipped" in result.stdout  # the printed table


def test_a_failing_check_fails_the_command(monkeypatch, capsys):
    from trainer.cli import selftest

    failing = [CheckResult("devices", PASS), CheckResult("collectives", FAIL, "", "RuntimeError: no route")]
    monkeypatch.setattr("trainer.selftest.run_selftest", lambda progress: failing)
    parser_args = type("Args", (), {"json": None})()
    assert selftest._run_selftest(parser_args) == 1
    assert "no route" in capsys.readouterr().out


@pytest.mark.gpu
def test_every_check_runs_and_passes_on_a_gpu_node():
    from trainer.selftest import run_selftest

    rows = {row.name: row for row in run_selftest(progress=lambda line: None)}
    assert set(rows) == EVERY_CHECK
    assert all(row.status == PASS for row in rows.values()), [row for row in rows.values() if row.status != PASS]
