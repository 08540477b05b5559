"""A real MLflow tracking server (``mlflow server``, SQLite store, artifacts in the temp dir) and a
2-rank CPU run tracked in it, stopped by SIGTERM (a preemption: `instcls launch` exits 143) and
resumed: still one MLflow run, whose params are the resolved config, whose metric history is rank
0's JSON log, scalar for scalar over both starts, and whose artifacts are the run's run.json, summary
and model card.  The same run writes TensorBoard events too (``logging.tensorboard``): read back
with TensorBoard's own reader, they hold the same series, and no other rank wrote any."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.helpers.training import FAST, REPO, train_command
from trainer.checkpoint.checkpoint_files import complete_checkpoints
from trainer.checkpoint.tracking_state import tracked_run_id
from trainer.observability.record_sinks import scalars_of
from trainer.parallel.launch import free_port_run

pytestmark = pytest.mark.integration

EXPERIMENT = "instcls-test"


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port_run(1)
    log = tmp_path / "mlflow-server.log"
    with log.open("wb") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
             "--artifacts-destination", str(tmp_path / "mlflow-artifacts")],
            cwd=tmp_path, stdout=output, stderr=subprocess.STDOUT,
            env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert server.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except OSError:
                assert time.time() < deadline, "mlflow server did not answer /health in 120 s"
                time.sleep(0.5)
        from mlflow.tracking import MlflowClient

        MlflowClient(uri).search_experiments()  # the first API request loads the server's handlers: not the run's
        yield uri
    finally:
        server.terminate()
        server.wait(timeout=30)


def _flatten(prefix: str, value, into: dict) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}{key}.", item, into)
    else:
        into[prefix[:-1]] = value


def test_a_preempted_and_resumed_run_is_one_mlflow_run_equal_to_its_json_log(tiny_digits_split, tmp_path,
                                                                              mlflow_server):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    overrides = FAST + ["logging.log_every=1", "logging.metrics_port=0", "eval.knn_at_end=true",
                        "logging.tensorboard=true",
                        f"logging.mlflow.tracking_uri={mlflow_server}", f"logging.mlflow.experiment={EXPERIMENT}",
                        "logging.mlflow.run_name=digits",
                        # a loaded CI machine's server may take seconds to answer: a warning here would be the
                        # machine's, not the sink's (the bound itself is tests/unit/test_mlflow_sink.py's)
                        "logging.mlflow.request_timeout_s=60"]
    command = train_command(run_dir, tiny_digits_split, 2, overrides, resume="auto",
                            launcher=[sys.executable, "-m", "trainer.cli", "launch"])
    env = dict(os.environ, OMP_NUM_THREADS="1", INSTCLS_FAILPOINT="train.wait_for_sigterm,rank=0,step=2")
    first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in first.stdout:
        lines.append(line)
        if re.search(r"fail point train\.wait_for_sigterm .* waits", line):
            first.send_signal(signal.SIGTERM)  # what Kubernetes sends a preempted pod
            break
    lines.append(first.communicate(timeout=300)[0])
    assert first.returncode == 143, "".join(lines)[-4000:]
    resumed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and "resumed from" in output, output[-4000:]
    assert "MLflow" not in output, output[-4000:]  # no warning: the server took everything

    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    assert len(runs) == 1, [run.info.run_id for run in runs]
    run = runs[0]
    run_id = run.info.run_id
    assert (run.info.status, run.info.run_name) == ("FINISHED", "digits")
    last = complete_checkpoints(run_dir / "checkpoints")[-1]
    assert tracked_run_id(last) == run_id

    # params: the resolved config (MLflow keeps a param's first value; this resume changed none)
    provenance = json.loads((run_dir / "logs" / "run.json").read_text())
    assert json.loads(_artifact(client, run_id, "run.json", tmp_path)) == provenance  # the latest start's
    resolved = {}
    _flatten("", yaml.safe_load(provenance["config"]), resolved)
    assert set(run.data.params) == set(resolved)
    assert run.data.params["optim.epochs"] == str(resolved["optim.epochs"]) == "4"
    assert run.data.params["data.loader.batch_size"] == "64"
    assert run.data.params["logging.mlflow.tracking_uri"] == mlflow_server
    git = provenance["git"]
    assert run.data.tags["instcls.git_commit"] == (f"{git['commit']}{'-dirty' if git['dirty'] else ''}"
                                                   if git else "unknown")
    assert run.data.tags["instcls.restarts"] == "1"
    assert run.data.tags["instcls.data_digest"] == provenance["train_manifest"]["digest"]

    # metrics: every scalar of rank 0's log, both starts, at its step and time
    expected: dict[str, list] = {}
    with (run_dir / "logs" / "rank-00000.jsonl").open() as log:
        for record in map(json.loads, log):
            if (found := scalars_of(record)) is not None:
                step, scalars = found
                for key, value in scalars.items():
                    expected.setdefault(key, []).append((step, value, int(record["time"] * 1000)))
    assert {"eval/knn_trained", "eval/knn_random_init", "summary/images", "train/lr"} <= set(expected)
    assert {step for step, _, _ in expected["train/loss"]} == set(range(1, 5))  # 4 epochs of 1 step
    assert set(run.data.metrics) == set(expected)
    for key, history in expected.items():
        logged = sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))
        assert logged == sorted(history), key

    _assert_tensorboard_holds(expected, run_dir)

    files = {item.path for item in client.list_artifacts(run_id)}
    assert files == {"run.json", "summary.json", "model_card.md"}
    summary = json.loads(_artifact(client, run_id, "summary.json", tmp_path))
    assert summary["stopped_by"] == "finished" and summary["steps"] == 4
    card = _artifact(client, run_id, "model_card.md", tmp_path)
    assert card == (run_dir / "logs" / "model_card.md").read_text() and card.startswith("# ")


def _assert_tensorboard_holds(expected: dict[str, list], run_dir: Path) -> None:
    """Rank 0's event files (one per start) hold every series of its JSON log, as float32."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = {file.parent for file in run_dir.rglob("events.out.tfevents.*")}
    assert folders == {run_dir / "logs" / "tensorboard"}, folders
    events = EventAccumulator(str(run_dir / "logs" / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep all
    events.Reload()
    written = {tag: sorted((e.step, e.value) for e in events.Scalars(tag)) for tag in events.Tags()["scalars"]}
    assert sorted(written) == sorted(expected)
    for tag, history in expected.items():
        assert written[tag] == sorted((step, float(np.float32(value))) for step, value, _ in history), tag


def _artifact(client, run_id: str, name: str, tmp_path) -> str:
    folder = tmp_path / "downloaded" / name
    folder.mkdir(parents=True, exist_ok=True)
    return Path(client.download_artifacts(run_id, name, str(folder))).read_text()
