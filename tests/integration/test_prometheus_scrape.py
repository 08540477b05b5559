"""A real Prometheus server scrapes a 2-rank CPU training run and, beside it, a fixture in NVIDIA's DCGM
exporter's exposition format (tests/fixtures/dcgm_exporter.prom), and answers every query of the
Grafana dashboard with data: the DCGM panels find the GPUs of the job's pod by the labels the exporter
carries under a PodMonitor or ServiceMonitor scrape (its own pod and namespace arrive as
``exported_pod`` and ``exported_namespace``, the scrape's target taking ``pod`` and ``namespace``).

Needs Debian's `prometheus` binary; `make test` installs it (apt) when it is missing.
"""

import functools
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.k8s_manifests import dashboard_queries
from tests.helpers.training import FAST, REPO, train_command
from trainer.parallel.launch import free_port_run

pytestmark = pytest.mark.integration

DCGM_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm_exporter.prom"
JOB_POD = {"pod": "instcls-train-0-x7k2p", "namespace": "ml"}  # the pod the fixture's GPUs belong to


class _Exporter(http.server.BaseHTTPRequestHandler):
    def do_GET(self, text: bytes = b"") -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, *args) -> None:
        pass


def serve_dcgm_fixture() -> http.server.ThreadingHTTPServer:
    handler = type("DcgmExporter", (_Exporter,), {"do_GET": functools.partialmethod(
        _Exporter.do_GET, text=DCGM_FIXTURE.read_bytes())})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


@pytest.fixture
def prometheus_binary():
    binary = shutil.which("prometheus")
    if binary is None:
        advice = "Debian's prometheus binary is missing: run `make test` (it installs it as root) or " \
                 "`apt-get install prometheus`"
        if os.geteuid() == 0 or os.environ.get("CI"):  # `make test` installs it as root; CI must run it
            pytest.fail(advice)
        pytest.skip(advice)  # a user without root cannot install it; the rest of the suite still runs
    return binary


def test_prometheus_scrapes_both_ranks_of_a_training_run(digits_split, tmp_path, prometheus_binary):
    metrics_port, prometheus_port = free_port_run(2), free_port_run(1)  # rank r serves metrics_port + r
    while prometheus_port in (metrics_port, metrics_port + 1):
        prometheus_port = free_port_run(1)
    config = tmp_path / "prometheus.yml"
    exporter = serve_dcgm_fixture()
    # Target labels as a PodMonitor's: the rank's pod, and the exporter's own pod (a DaemonSet's)
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: instcls\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}', '127.0.0.1:{metrics_port + 1}'], "
        f"labels: {json.dumps(JOB_POD)}}}]\n"
        "  - job_name: dcgm-exporter\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{exporter.server_address[1]}'], "
        "labels: {pod: nvidia-dcgm-exporter-5xq9z, namespace: gpu-operator}}]\n"
    )
    server = subprocess.Popen([prometheus_binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # an evaluation every epoch, so that the kNN panel has data too
    command = train_command(tmp_path / "run", digits_split, 2,
                            FAST + ["optim.epochs=50", "logging.log_every=1", f"logging.metrics_port={metrics_port}",
                                    "eval.every_epochs=1"],
                            launcher=[sys.executable, "-m", "trainer.cli", "launch"])
    training_log = tmp_path / "training.log"
    with training_log.open("wb") as log:
        training = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, OMP_NUM_THREADS="1"))
    # every panel's expression, as Grafana sends it with "All" jobs selected
    _, queries = dashboard_queries()
    panels = [q.replace('=~"$job"', '=~".+"') for q in queries if not q.startswith("label_values")]
    try:
        deadline, answers = time.time() + 300, {}
        while time.time() < deadline:
            time.sleep(2)
            # a failed run cannot fill the panels: say why at once rather than at the deadline
            assert training.poll() in (None, 0), f"training exited {training.returncode}:\n" + \
                training_log.read_text(errors="replace")[-4000:]
            try:
                answers = {promql: query(prometheus_port, promql) for promql in panels}
            except OSError:
                continue  # Prometheus still starting
            samples = answers[panels[0]] and query(prometheus_port, "instcls_samples_processed_total > 0")
            if all(answers.values()) and samples and len({s["metric"]["rank"] for s in samples}) == 2:
                break
        assert not [promql for promql, series in answers.items() if not series], \
            (answers, training_log.read_text(errors="replace")[-4000:])
        samples = query(prometheus_port, "instcls_samples_processed_total > 0")
        assert sorted(s["metric"]["rank"] for s in samples) == ["0", "1"], samples
        quantile = query(prometheus_port, "histogram_quantile(0.5, sum by (le) "
                                          "(rate(instcls_step_duration_seconds_bucket[1m])))")
        assert quantile and float(quantile[0]["value"][1]) > 0, quantile
        phases = {s["metric"]["phase"] for s in query(prometheus_port, "instcls_step_phase_seconds_total > 0")}
        assert {"forward", "objective", "backward", "optimizer"} <= phases, phases
        # the DCGM panels: the fixture's two GPUs, matched to the job's pod, averaged or summed
        dcgm = {promql: series for promql, series in answers.items() if "DCGM_" in promql}
        assert len(dcgm) == 4, list(dcgm)
        for series in dcgm.values():
            assert [s["metric"] for s in series] == [{"pod": JOB_POD["pod"]}], series
        values = {re.search(r"DCGM_[A-Z_]+", promql).group(): float(series[0]["value"][1])
                  for promql, series in dcgm.items()}
        assert values == {"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": pytest.approx(0.40),
                          "DCGM_FI_PROF_GR_ENGINE_ACTIVE": pytest.approx(0.92),
                          "DCGM_FI_DEV_FB_USED": (61234 + 60987) * 2**20,
                          "DCGM_FI_DEV_POWER_USAGE": pytest.approx(1210.75)}, values
    finally:
        training.send_signal(signal.SIGTERM)
        training.wait(timeout=120)
        server.terminate()
        server.wait(timeout=30)
        exporter.shutdown()
