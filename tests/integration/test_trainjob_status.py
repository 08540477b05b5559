"""`logging.trainjob_status`: rank 0 POSTs the run's progress to the status endpoint that Kubeflow
Trainer injects (``KUBEFLOW_TRAINER_SERVER_URL``, ``_CA_CERT``, ``_TOKEN``), as the pinned release's
status server takes it.  A local HTTPS server with its own CA stands in for it: every request is a
POST to the TrainJob's status path with the pod's bearer token, and every body validates, as a closed
object, against the vendored TrainJob schema's ``status.trainerStatus``.  The server refuses the first
report (403): the run logs one warning and trains on to the end, whose report says 100%."""

from __future__ import annotations

import http.server
import json
import os
import ssl
import subprocess
import threading

import pytest
import trustme

from tests.helpers.crd_schemas import validate_closed, vendored
from trainer.drills.jobs import REPO, train_command
from trainer.observability.trainjob_status import CA_ENV, TOKEN_ENV, URL_ENV

pytestmark = pytest.mark.integration

STATUS_PATH = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs/instcls-train/status"
TOKEN = "projected-service-account-token"


class StatusServer(http.server.ThreadingHTTPServer):
    def __init__(self, context: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), StatusHandler)
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.requests: list[dict] = []


class StatusHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append(dict(method=self.command, path=self.path, headers=dict(self.headers),
                                         body=json.loads(body)))
        refused = len(self.server.requests) == 1
        self.send_response(403 if refused else 200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"reason": "Forbidden"}' if refused else body)

    def log_message(self, *args) -> None:
        pass


def test_rank_0_reports_progress_to_the_trainjob_status_endpoint_and_trains_on_after_a_403(tiny_digits_split,
                                                                                            tmp_path):
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    (tmp_path / "token").write_text(TOKEN + "\n")
    server = StatusServer(context)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = dict(os.environ, OMP_NUM_THREADS="1", **{
        URL_ENV: f"https://127.0.0.1:{server.server_address[1]}{STATUS_PATH}",
        CA_ENV: str(tmp_path / "ca.crt"), TOKEN_ENV: str(tmp_path / "token")})
    try:
        result = subprocess.run(train_command(tmp_path / "run", tiny_digits_split, 1, [
            "logging.trainjob_status=true", "logging.progress_every_s=0", "logging.log_every=1", "max_steps=4",
            "data.loader.batch_size=32"]), cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr[-3000:]
    requests = server.requests
    assert len(requests) >= 3, requests  # log steps, then the run's end
    trainer_status = vendored("trainer.kubeflow.org_trainjobs.v2.3.0.json")["openAPIV3Schema"]["properties"][
        "status"]["properties"]["trainerStatus"]
    for request in requests:
        assert request["method"] == "POST" and request["path"] == STATUS_PATH
        assert request["headers"]["Authorization"] == f"Bearer {TOKEN}"
        assert request["headers"]["Content-Type"] == "application/json"
        assert set(request["body"]) == {"trainerStatus"}
        validate_closed(request["body"]["trainerStatus"], trainer_status)
    last = requests[-1]["body"]["trainerStatus"]
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    assert {"loss", "images_per_s_per_rank"} <= {metric["name"] for metric in requests[-2]["body"]["trainerStatus"][
        "metrics"]}
    output = result.stdout + result.stderr
    assert output.count("did not take the progress report: HTTP 403") == 1, output[-3000:]


def test_a_misspelled_status_field_fails_the_closed_schema():
    """The check above can fail: the schema, closed, refuses a field the Trainer API does not have."""
    trainer_status = vendored("trainer.kubeflow.org_trainjobs.v2.3.0.json")["openAPIV3Schema"]["properties"][
        "status"]["properties"]["trainerStatus"]
    import jsonschema

    with pytest.raises(jsonschema.ValidationError, match="progressPercent"):
        validate_closed({"progressPercent": 50, "lastUpdatedTime": "2026-12-02T00:00:00Z"}, trainer_status)
