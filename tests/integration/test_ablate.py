"""`instcls ablate` end to end, in its smallest form: one ablation, one seed, one epoch per run,
on the plain digits.  The full sweep (`make ablate`, ~37 minutes) writes docs/ablations.md."""

import json
import subprocess
import sys

import pytest

from trainer.ablations.catalogue import select
from trainer.ablations.document import Sweep, render, summary_table, verdicts_of
from trainer.ablations.runner import RunResult, SweepSettings
from trainer.ablations.verdict import NOT_MEASURED
from trainer.drills.jobs import REPO, job_env
from trainer.observability.report import RunLogs

pytestmark = pytest.mark.integration

COMMAND = "instcls ablate --only head --seeds 1"  # the command the document names as its author


def ablate(digits_split, work_dir, doc, *extra):
    command = [sys.executable, "-m", "trainer.cli", "ablate", "--only", "head", "--seeds", "1",
               "--train-shards", str(digits_split["train"]), "--val-shards", str(digits_split["val"]),
               "--work-dir", str(work_dir), "--doc", str(doc), "--set", "optim.epochs=1", *extra]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=job_env())


@pytest.mark.slow  # default suite: the verdicts and the document from recorded results (tests/unit/test_ablations.py)
def test_ablate_trains_each_variant_and_writes_what_it_measured(digits_split, tmp_path):
    doc = tmp_path / "docs" / "ablations.md"
    first = ablate(digits_split, tmp_path / "runs", doc)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    runs = sorted((tmp_path / "runs").glob("*/result.json"))
    assert len(runs) == 2  # MLP head and linear head, seed 0
    results = []
    for path in runs:
        result = json.loads(path.read_text())
        logs = RunLogs.read(path.parent / "logs")
        final = logs.events("eval")[-1]
        assert result["knn_final"] == final["knn_trained"] and result["knn_random_init"] == final["knn_random_init"]
        assert not (path.parent / "checkpoints").exists()  # a finished run keeps its logs, not its weights
        results.append(RunResult.from_json(result))
    (head,) = select(["head"])
    labels = [variant.label for variant in head.variants]
    assert sorted(r.variant for r in results) == sorted(labels)
    results.sort(key=lambda r: labels.index(r.variant))  # the sweep's order
    sweep = Sweep(SweepSettings(digits_split["train"], digits_split["val"]), (head,), results, COMMAND)
    # The ablation's one claim, judged on what its two runs measured (one seed: the sign decides).
    (verdict,) = verdicts_of(sweep)["head"]
    assert (verdict.claim.kind, verdict.claim.better, verdict.claim.worse) == ("beats", "MLP head", "linear head")
    assert verdict.outcome != NOT_MEASURED
    assert verdict.difference == pytest.approx(100 * (results[0].knn_final - results[1].knn_final))
    # The document and the printed verdicts are those results rendered (their text: test_ablations.py).
    text = doc.read_text()
    assert text == render(sweep, doc.with_suffix(".png").name)
    assert "\n".join(summary_table(sweep, verdicts_of(sweep))) in first.stdout
    assert doc.with_suffix(".png").stat().st_size > 10_000

    # Asked again, nothing trains: both runs are read back and the document comes out the same.
    measured = {path: path.stat().st_mtime_ns for path in runs}
    doc.unlink()
    again = ablate(digits_split, tmp_path / "runs", doc)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "runs").glob("*/result.json")} == measured
    assert doc.read_text() == text

    # A typo in an override stops the sweep before any job starts, naming the field.
    wrong = ablate(digits_split, tmp_path / "runs", doc, "--set", "optim.epoch=1")
    assert wrong.returncode == 2 and "unknown field optim.epoch; did you mean optim.epochs?" in wrong.stderr
