"""A real Prometheus server scrapes a 2-rank CPU training run and answers every query of the Grafana
dashboard with data.

Needs Debian's `prometheus` binary; `make test` installs it (apt) when it is missing.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from tests.helpers.k8s_manifests import dashboard_queries
from tests.helpers.training import FAST, REPO, train_command
from trainer.parallel.launch import free_port

pytestmark = pytest.mark.integration


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
    metrics_port, prometheus_port = free_port(), free_port()
    while prometheus_port in (metrics_port, metrics_port + 1):
        prometheus_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: instcls\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}', '127.0.0.1:{metrics_port + 1}']}}]\n"
    )
    server = subprocess.Popen([prometheus_binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # an evaluation every epoch, so that the kNN panel has data too
    command = train_command(tmp_path / "run", digits_split, 2,
                            FAST + ["optim.epochs=50", "logging.log_every=1", f"logging.metrics_port={metrics_port}",
                                    "eval.every_epochs=1"],
                            launcher=[sys.executable, "-m", "trainer.cli", "launch"])
    training = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    # every panel's expression, as Grafana sends it with "All" jobs selected
    _, queries = dashboard_queries()
    panels = [q.replace('=~"$job"', '=~".+"') for q in queries if not q.startswith("label_values")]
    try:
        deadline, answers = time.time() + 300, {}
        while time.time() < deadline:
            time.sleep(2)
            try:
                answers = {promql: query(prometheus_port, promql) for promql in panels}
            except OSError:
                continue  # Prometheus still starting
            samples = answers[panels[0]] and query(prometheus_port, "instcls_samples_processed_total > 0")
            if all(answers.values()) and samples and len({s["metric"]["rank"] for s in samples}) == 2:
                break
        assert not [promql for promql, series in answers.items() if not series], answers
        samples = query(prometheus_port, "instcls_samples_processed_total > 0")
        assert sorted(s["metric"]["rank"] for s in samples) == ["0", "1"], samples
        quantile = query(prometheus_port, "histogram_quantile(0.5, sum by (le) "
                                          "(rate(instcls_step_duration_seconds_bucket[1m])))")
        assert quantile and float(quantile[0]["value"][1]) > 0, quantile
        phases = {s["metric"]["phase"] for s in query(prometheus_port, "instcls_step_phase_seconds_total > 0")}
        assert {"forward", "objective", "backward", "optimizer"} <= phases, phases
    finally:
        training.send_signal(signal.SIGTERM)
        training.wait(timeout=120)
        server.terminate()
        server.wait(timeout=30)
