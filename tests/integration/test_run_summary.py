"""A run stopped by ``max_steps`` ends cleanly, so its log ends with the run's summary: its steps,
training time, images and peak memory, and how it ended (a SIGTERM stop writes the same record:
``Trainer._train`` writes it for every clean end)."""

import json

import pytest

from tests.helpers.training import FAST, run_train
from trainer.observability.report import RunLogs, summary_rows

pytestmark = pytest.mark.integration


def test_a_max_steps_run_logs_its_summary_with_its_peak_memory(tiny_digits_split, tmp_path):
    run_train(tmp_path, tiny_digits_split, 1, FAST + ["max_steps=1"])  # stops inside the first epoch
    records = [json.loads(line) for line in (tmp_path / "logs" / "rank-00000.jsonl").read_text().splitlines()]
    summaries = [r for r in records if r["event"] == "summary"]
    assert len(summaries) == 1 and records[-1]["event"] == "summary", records[-3:]
    summary = summaries[0]
    assert (summary["stopped_by"], summary["steps"], summary["images"]) == ("max_steps", 1, 64), summary
    assert summary["peak_memory_kind"] == "rss_high_water" and summary["peak_memory_bytes"] > 100 << 20, summary
    assert summary["seconds"] > 0, summary  # the stopped epoch's steps count as training time
    assert dict(summary_rows(RunLogs.read(tmp_path / "logs")))["images/s (all ranks)"] != "0.0"
