"""Rank 0's MLflow sink without a tracking server: what it sends for the JSON log's records, how a
resume with other settings is recorded, and that a server that fails costs one warning within the
stated bound while the training thread never waits (a real HTTP server answering 500, one that never
answers, and a port nobody listens on)."""

import http.server
import logging
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from trainer.config import load_job_config
from trainer.config_tracking import MlflowSettings
from trainer.observability.mlflow_sink import MlflowSink, changed_params, flat_params, run_tags
from trainer.observability.record_sinks import scalars_of
from trainer.parallel.launch import free_port_run

CONFIG = "configs/digits_cpu.yaml"


class RecordingClient:
    """The MlflowClient calls the sink makes, recorded; ``logged``: the params of an existing run."""

    def __init__(self, logged: dict | None = None) -> None:
        self.calls: list[tuple] = []
        self.logged = logged

    def get_run(self, run_id):
        self.calls.append(("get_run", run_id))
        return SimpleNamespace(data=SimpleNamespace(params=self.logged))

    def update_run(self, run_id, status):
        self.calls.append(("update_run", run_id, status))

    def get_experiment_by_name(self, name):
        return None

    def create_experiment(self, name):
        self.calls.append(("create_experiment", name))
        return "7"

    def create_run(self, experiment_id, run_name=None):
        self.calls.append(("create_run", experiment_id, run_name))
        return SimpleNamespace(info=SimpleNamespace(run_id="run-1"))

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self.calls.append(("log_batch", run_id, [(m.key, m.value, m.step, m.timestamp) for m in metrics],
                           {p.key: p.value for p in params}, {t.key: t.value for t in tags}))

    def log_artifact(self, run_id, path):
        with open(path) as file:
            self.calls.append(("log_artifact", run_id, path.rsplit("/", 1)[-1], file.read()))

    def set_terminated(self, run_id, status):
        self.calls.append(("set_terminated", run_id, status))


def _sink(client, resumed=None, warnings=None, restarts=0):
    settings = MlflowSettings(tracking_uri="http://tracking.invalid", experiment="exp", run_name="name")
    return MlflowSink(settings, {"optim.base_lr": "0.1", "data.loader.batch_size": "64"}, {"instcls.version": "1"},
                      restarts, resumed, (warnings if warnings is not None else []).append,
                      client_factory=lambda uri: client)


def _steps(first: int, last: int) -> list[dict]:
    return [{"time": 1000.0 + step, "event": "step", "step": step, "loss": 5.0 - step / 10,
             "memory_bytes": {"rss": 100 + step}} for step in range(first, last + 1)]


def test_the_config_is_flattened_field_by_field():
    config = load_job_config(CONFIG)
    params = flat_params(config)
    assert params["optim.base_lr"] == str(config.optim.base_lr)
    assert params["data.loader.batch_size"] == str(config.data.loader.batch_size)
    assert params["parallel.elastic.memory_margin"] == str(config.parallel.elastic.memory_margin)
    assert params["logging.mlflow.tracking_uri"] == ""
    assert all(isinstance(value, str) and len(value) <= 6000 for value in params.values())
    assert not any(key.endswith(".") or ".." in key for key in params)


def test_a_changed_setting_on_resume_becomes_a_tag_and_new_fields_become_params():
    new, tags = changed_params({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}, restarts=2)
    assert new == {"c": "4"}
    assert tags == {"instcls.changed.b": "2 -> 3 at restart 2"}


def test_tags_name_the_code_image_hosts_and_data():
    provenance = {"instcls_version": "0.2.0", "git": {"commit": "abc", "dirty": True}, "image": "reg/instcls:1",
                  "hosts": ["n0", "n1"], "train_manifest": {"digest": "sha256:ff"}, "world_size": 2}
    assert run_tags(provenance, 3) == {
        "instcls.version": "0.2.0", "instcls.git_commit": "abc-dirty", "instcls.image": "reg/instcls:1",
        "instcls.hosts": "n0,n1", "instcls.data_digest": "sha256:ff", "instcls.world_size": "2",
        "instcls.restarts": "3"}


def test_every_scalar_of_the_log_reaches_the_run_in_order_retrained_steps_twice(tmp_path):
    client = RecordingClient()
    sink = _sink(client)
    records = [*_steps(1, 4), *_steps(3, 5)]  # a resume from step 2's checkpoint trains 3 and 4 again
    for record in records:
        sink.write(record)
    (tmp_path / "run.json").write_text('{"run": 1}')
    sink.attach(tmp_path / "run.json", "run.json")
    sink.write({"time": 2000.0, "event": "summary", "steps": 5, "images": 320, "stopped_by": "finished"})
    sink.close()
    sent = [metric for call in client.calls if call[0] == "log_batch" for metric in call[2]]
    expected = [(key, value, step, int(record["time"] * 1000))
                for record in [*records, {"time": 2000.0, "event": "summary", "steps": 5, "images": 320}]
                for step, scalars in [scalars_of(record)] for key, value in scalars.items()]
    assert sent == expected
    assert [m[2] for m in sent if m[0] == "train/loss"] == [1, 2, 3, 4, 3, 4, 5]
    assert client.calls[:2] == [("create_experiment", "exp"), ("create_run", "7", "name")]
    params = {key: value for call in client.calls if call[0] == "log_batch" for key, value in call[3].items()}
    assert params == {"optim.base_lr": "0.1", "data.loader.batch_size": "64"}
    assert ("log_artifact", "run-1", "run.json", '{"run": 1}') in client.calls
    assert client.calls[-1] == ("set_terminated", "run-1", "FINISHED")
    assert sink.run_id == "run-1"


@pytest.mark.parametrize(("summary", "status"), [({"stopped_by": "sigterm"}, "KILLED"), (None, "FAILED"),
                                                  ({"stopped_by": "max_steps"}, "FINISHED")])
def test_the_run_ends_with_the_status_of_how_training_ended(summary, status):
    client = RecordingClient()
    sink = _sink(client)
    if summary is not None:
        sink.write({"time": 1.0, "event": "summary", "steps": 3, **summary})
    sink.close()
    assert client.calls[-1] == ("set_terminated", "run-1", status)


def test_a_resume_continues_the_run_without_logging_a_param_again():
    client = RecordingClient(logged={"optim.base_lr": "0.1", "data.loader.batch_size": "32"})
    warnings = []
    sink = _sink(client, resumed="run-0", warnings=warnings, restarts=1)
    assert sink.run_id == "run-0"  # known at once: the first checkpoint of the resumed run keeps it
    sink.close()
    assert ("create_run", "7", "name") not in client.calls
    assert client.calls[:2] == [("get_run", "run-0"), ("update_run", "run-0", "RUNNING")]
    batches = [call for call in client.calls if call[0] == "log_batch"]
    changed = {"instcls.version": "1", "instcls.changed.data.loader.batch_size": "32 -> 64 at restart 1"}
    assert batches == [("log_batch", "run-0", [], {}, changed)]
    assert warnings == []


class _Answers500(http.server.BaseHTTPRequestHandler):
    def _fail(self) -> None:
        self.send_response(500)
        self.end_headers()

    do_GET = do_POST = _fail  # noqa: N815 (http.server's names)

    def log_message(self, *args) -> None:
        pass


def _silent_listener():
    """A socket that accepts connections and never answers (a hung server)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    return listener, f"http://127.0.0.1:{listener.getsockname()[1]}"


def _answers_500():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers500)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize("server", ["answers 500", "never answers", "nobody listens"])
def test_a_failing_server_costs_one_warning_within_the_bound_and_never_holds_training(server, monkeypatch, caplog):
    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER"):
        monkeypatch.delenv(name, raising=False)  # the sink sets them for the process: not for the next test
    if server == "answers 500":
        held, uri = _answers_500()
    elif server == "never answers":
        held, uri = _silent_listener()
    else:
        held, uri = None, f"http://127.0.0.1:{free_port_run(1)}"
    settings = MlflowSettings(tracking_uri=uri, request_timeout_s=1.0, retries=1)
    import mlflow.entities  # noqa: F401 - imported before the clock starts: the bound is the requests'
    import mlflow.tracking  # noqa: F401

    warnings, warned_at = [], []
    started = time.monotonic()
    sink = MlflowSink(settings, {"a": "1"}, {}, 0, None, lambda line: (warnings.append(line),
                                                                      warned_at.append(time.monotonic())))
    try:
        writing = time.monotonic()
        for record in _steps(1, 200):
            sink.write(record)
        assert time.monotonic() - writing < 0.5  # the training thread only queues
        deadline = started + settings.warning_bound_s + 4
        while not warnings and time.monotonic() < deadline:
            time.sleep(0.05)
        sink.close()
    finally:
        if isinstance(held, socket.socket):
            held.close()
        elif held is not None:
            held.shutdown()
            held.server_close()
    assert len(warnings) == 1, warnings
    # the bound, plus a margin for a loaded machine's thread start and connection set-up
    assert warned_at[0] - started <= settings.warning_bound_s + 3, (warned_at[0] - started, settings.warning_bound_s)
    assert uri in warnings[0] and "Training goes on" in warnings[0]
    # nor do the HTTP client's own retry lines reach the pod log: the one warning is the only line
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == []
