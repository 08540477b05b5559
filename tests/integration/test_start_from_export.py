"""A 2-rank run started from an export (``model.init_from``): its baseline, scored before its first
step, is the exported network's kNN figure on the same eval shards (what `instcls eval knn` gives
the exporting checkpoint); its ``run.json``, in its logs and in its checkpoint, holds the resolved
config (it loads as the same job), the overrides as given, the code's commit, both ranks' hosts and
the digest of the file it started from."""

import re

import pytest

from tests.helpers.checkpoints import write_checkpoint
from tests.helpers.training import REPO, run_train
from trainer.checkpoint.initial_weights import starting_network
from trainer.cli import main
from trainer.config import load_job_config
from trainer.drills.jobs import train_arguments
from trainer.export import export_checkpoint
from trainer.observability.report import RunLogs
from trainer.provenance import file_sha256, read_provenance

pytestmark = pytest.mark.integration

DIGITS = REPO / "configs" / "digits_cpu.yaml"
RUN = ["data.loader.batch_size=32", "optim.epochs=1", "eval.knn_at_end=true", "checkpoint.every_epochs=1"]


@pytest.mark.slow  # default suite: an export's weights as init_from in tests/unit/test_initial_weights.py, run.json in
# tests/unit/test_run_provenance.py
def test_a_run_from_an_export_starts_from_its_network_and_records_its_provenance(tiny_digits_split, tmp_path,
                                                                                 capsys):
    shards = [f"data.train_shards={tiny_digits_split['train']}", f"data.eval_shards={tiny_digits_split['val']}"]
    source = load_job_config(DIGITS, [*shards, *RUN, "seed=7", f"checkpoint.dir={tmp_path / 'source'}"])
    checkpoint = write_checkpoint(source, starting_network(source), step=6)  # another seed's network
    export = export_checkpoint(source, checkpoint, tmp_path / "export")
    arguments = ["eval", "knn", "--config", str(DIGITS), "--checkpoint", str(checkpoint)]
    assert main(arguments + [item for s in [*shards, *RUN] for item in ("--set", s)]) == 0
    exported_knn = float(re.search(r"\((\d\.\d+); held-out", capsys.readouterr().out).group(1))

    run_dir = tmp_path / "run"
    overrides = [*RUN, f"model.init_from={export}"]
    result = run_train(run_dir, tiny_digits_split, 2, overrides)
    weights = export / "model.safetensors"
    assert f"model.init_from: 120 backbone tensors from {weights}" in result.stdout, result.stdout[-3000:]
    final = RunLogs.read(run_dir / "logs").last("eval")
    assert final["baseline"] == "init_from" and final["knn_random_init"] == exported_knn, (final, exported_knn)
    assert "start (model.init_from)" in result.stdout

    record = read_provenance(run_dir / "logs")
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [c.name for c in checkpoints] == ["step_000000002"]
    assert all(read_provenance(c) == record for c in checkpoints), "every checkpoint carries its run's record"
    assert record["init_from"] == {"path": str(weights), "digest": file_sha256(weights)}
    given = train_arguments(run_dir, tiny_digits_split, overrides)
    assert record["overrides"] == [given[i + 1] for i, item in enumerate(given) if item == "--set"]
    (tmp_path / "resolved.yaml").write_text(record["config"])
    assert load_job_config(tmp_path / "resolved.yaml") == load_job_config(DIGITS, record["overrides"])
    assert (record["world_size"], len(record["hosts"])) == (2, 2) and record["resumed_from"] is None
    assert re.fullmatch(r"[0-9a-f]{40}", record["git"]["commit"]), record["git"]
    assert record["train_manifest"]["images"] == 128
