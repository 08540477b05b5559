"""`instcls report`: the summary table and the curves, read back from a run's JSONL logs."""

import json

import pytest

from trainer.cli import main
from trainer.observability.report import RunLogs, summary_rows

MIB = 1 << 20


def _write_logs(directory, ranks=2, finished=True):
    directory.mkdir(parents=True)
    for rank in range(ranks):
        records = [{"event": "step", "step": s, "loss": 7.0 - s / 10, "images_per_s": 50.0 + rank,
                    "memory_bytes": {"rss": (400 + rank + s) * MIB}} for s in (1, 5, 10)]
        if rank == 0:
            records += [{"event": "eval", "epoch": 1, "final": False, "knn_trained": 0.25, "knn_random_init": 0.2},
                        {"event": "eval", "epoch": 2, "final": True, "knn_trained": 0.5, "knn_random_init": 0.2,
                         "linear_trained": 0.625, "linear_random_init": 0.375,
                         "linear_curve": {"0.1": 0.3125, "0.5": 0.5, "1.0": 0.625}}]
        if finished:
            records.append({"event": "summary", "objective": "instance", "epochs": 2, "steps": 10,
                            "seconds": 20.0, "images": 1000 * (rank + 1), "peak_memory_bytes": (512 + rank) * MIB,
                            "peak_memory_kind": "rss_high_water"})
        (directory / f"rank-{rank:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def test_the_summary_adds_throughput_over_ranks_and_reports_the_final_evaluation(tmp_path):
    rows = dict(summary_rows(RunLogs.read(_write_logs(tmp_path / "logs"))))
    assert rows["objective"] == "instance" and rows["epochs"] == "2"
    assert rows["kNN, trained"] == "50.00%" and rows["kNN, random init"] == "20.00%"  # the last eval, not the first
    assert rows["linear probe, trained"] == "62.50%" and rows["linear probe, random init"] == "37.50%"
    assert rows["linear probe by share of labels"] == "10%: 31.25%, 50%: 50.00%, 100%: 62.50%"
    assert rows["images/s (all ranks)"] == "150.0"  # 1000/20 + 2000/20
    assert rows["peak memory per rank, MiB (RSS)"] == "512, 513"


def test_the_report_command_prints_the_table_and_writes_the_png(tmp_path, capsys):
    logs = _write_logs(tmp_path / "logs")
    assert main(["report", "--logs", str(logs), "--png", str(tmp_path / "out" / "run.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    # Each summary row is a table row holding its field and value (the one test of summary_table's text).
    for field, value in summary_rows(RunLogs.read(logs)):
        assert [line for line in out if line.startswith(f"| {field} ") and line.endswith(f"| {value} |")], field
    assert (tmp_path / "out" / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unfinished_run_or_a_wrong_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no run summary: the run has not finished"):
        summary_rows(RunLogs.read(_write_logs(tmp_path / "logs", finished=False)))
    with pytest.raises(FileNotFoundError, match=r"empty: no rank-\*\.jsonl log files; pass the run's logging\.dir"):
        RunLogs.read((tmp_path / "empty"))
