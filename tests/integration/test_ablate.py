"""`instcls ablate` end to end, in its smallest form: one ablation, one seed, one epoch per run,
on the plain digits.  The full sweep (`make ablate`, ~37 minutes) writes docs/ablations.md."""

import json
import subprocess
import sys

from trainer.drills.jobs import REPO, job_env
from trainer.observability.report import RunLogs


def ablate(digits_split, work_dir, doc, *extra):
    command = [sys.executable, "-m", "trainer.cli", "ablate", "--only", "head", "--seeds", "1",
               "--train-shards", str(digits_split["train"]), "--val-shards", str(digits_split["val"]),
               "--work-dir", str(work_dir), "--doc", str(doc), "--set", "optim.epochs=1", *extra]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=job_env())


def test_ablate_trains_each_variant_and_writes_what_it_measured(digits_split, tmp_path):
    doc = tmp_path / "docs" / "ablations.md"
    first = ablate(digits_split, tmp_path / "runs", doc)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    runs = sorted((tmp_path / "runs").glob("*/result.json"))
    assert len(runs) == 2  # MLP head and linear head, seed 0
    text = doc.read_text()
    for path in runs:
        result = json.loads(path.read_text())
        logs = RunLogs.read(path.parent / "logs")
        final = logs.events("eval")[-1]
        assert result["knn_final"] == final["knn_trained"] and result["knn_random_init"] == final["knn_random_init"]
        assert not (path.parent / "checkpoints").exists()  # a finished run keeps its logs, not its weights
        # The document's row for this variant shows the accuracy its log holds.
        assert f"| {result['variant']} | {100 * final['knn_trained']:.2f} |" in text
    assert "| head | Paper 000, Table 2 | MLP head > linear head |" in text
    assert "| head | Paper 000, Table 2 | MLP head > linear head |" in first.stdout  # the verdicts, printed too
    assert doc.with_suffix(".png").stat().st_size > 10_000

    # Asked again, nothing trains: both runs are read back and the document comes out the same.
    doc.unlink()
    again = ablate(digits_split, tmp_path / "runs", doc)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("measured before") == 2 and doc.read_text() == text

    # A typo in an override stops the sweep before any job starts, naming the field.
    wrong = ablate(digits_split, tmp_path / "runs", doc, "--set", "optim.epoch=1")
    assert wrong.returncode == 2 and "unknown field optim.epoch; did you mean optim.epochs?" in wrong.stderr
