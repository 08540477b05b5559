"""Long-running commands write plain lines, never carriage returns, when their output goes to a
file (a pod log, `> out.log 2>&1`): a bar redrawn with \\r turns a log into one unreadable line.
Training and `instcls eval` are checked where the suite runs them (``run_train``, the eval test)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _run_to_file(args: list[str], log, cwd) -> bytes:
    with open(log, "wb") as out:
        result = subprocess.run([sys.executable, "-m", "trainer.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=cwd, timeout=600)
    text = log.read_bytes()
    assert result.returncode == 0, text[-3000:]
    return text


def test_shard_commands_write_plain_lines_to_a_file(tmp_path):
    shards = tmp_path / "shards"
    made = _run_to_file(["make-shards", "--source", "digits", "--split", "val", "--out", str(shards),
                         "--samples-per-shard", "64"], tmp_path / "make.log", tmp_path)
    checked = _run_to_file(["validate-shards", str(shards)], tmp_path / "validate.log", tmp_path)
    for text in (made, checked):
        assert b"\r" not in text, text[-2000:]
    # the progress is there, as lines: the last one says every shard was checked
    lines = checked.decode().splitlines()
    assert any(line.startswith("validate-shards: 6/6 shards (100.0%)") for line in lines), lines
    assert lines[-1] == f"checked 359 samples in {shards}: all good", lines
