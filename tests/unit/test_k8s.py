"""Manifests validate offline, ConfigMaps match the repository files, the dashboard only queries
metrics the exporter serves, and the image definition is sane."""

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from trainer.observability.metrics import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUBERNETES_VERSION = "1.31.0"
CUSTOM_SCHEMAS = {"PodMonitor": "podmonitor.schema.json", "PyTorchJob": "pytorchjob.schema.json"}


def all_documents():
    for path in sorted(K8S.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                yield path.name, document


def test_every_manifest_validates():
    kinds = set()
    for name, document in all_documents():
        kind = document["kind"]
        kinds.add(kind)
        if kind in CUSTOM_SCHEMAS:
            schema = json.loads((K8S / "schemas" / CUSTOM_SCHEMAS[kind]).read_text())
            jsonschema.validate(document, schema)
            pod_spec = (document["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
                        if kind == "PyTorchJob" else None)
            if pod_spec:  # the embedded pod template is a built-in kind: validate it as one
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                              "template": pod_spec}, KUBERNETES_VERSION, strict=True)
        else:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    assert {"Job", "Service", "ConfigMap", "PersistentVolumeClaim", "PodMonitor", "PyTorchJob"} <= kinds


def test_validation_catches_a_broken_manifest():
    _, job = next((n, d) for n, d in all_documents() if d["kind"] == "Job")
    job["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "not-a-port"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)
    monitor = next(d for _, d in all_documents() if d["kind"] == "PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "often"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, json.loads((K8S / "schemas/podmonitor.schema.json").read_text()))


def test_training_pods_have_what_the_job_needs():
    job = next(d for _, d in all_documents() if d["kind"] == "Job")
    spec = job["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["subdomain"] == "instcls-train" and pod["terminationGracePeriodSeconds"] >= 300
    assert "--node-rank=$(JOB_COMPLETION_INDEX)" in container["args"] and "--rdzv-backend=c10d" in container["args"]
    assert container["command"] == ["instcls", "launch"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["job-config"]["configMap"]["name"] == "instcls-job"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    monitor = next(d for _, d in all_documents() if d["kind"] == "PodMonitor")
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert scraped == {name for name in ports if name.startswith("metrics-")}
    assert sorted(ports[name] for name in scraped) == list(range(9400, 9408))  # metrics_port + local rank


def test_configmaps_embed_the_repository_files_unchanged():
    import importlib.util

    spec = importlib.util.spec_from_file_location("render", K8S / "render_configmaps.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    for name, text in render.rendered().items():
        assert (K8S / name).read_text() == text, f"k8s/{name} is stale: run python k8s/render_configmaps.py"
    data = yaml.safe_load((K8S / "configmap-in1k.yaml").read_text())["data"]
    assert data["job.yaml"] == (ROOT / "configs/in1k_r50_64gpu.yaml").read_text()


def dashboard_queries():
    dashboard = json.loads((K8S / "grafana/instcls-dashboard.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return dashboard, queries


def test_dashboard_queries_only_exported_metrics_and_covers_the_brief():
    dashboard, queries = dashboard_queries()
    used = set()
    for query in queries:
        for name in re.findall(r"instcls_[a-z_]+", query):
            used.add(re.sub(r"_(bucket|sum|count)$", "", name) if "step_duration_seconds" in name else name)
    assert used and used <= set(METRIC_NAMES), used - set(METRIC_NAMES)
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("images/s", "p50", "p95", "data-loader wait", "loss", "learning rate", "memory per rank",
                  "communication", "epoch progress", "eta", "knn accuracy"):
        assert topic in titles, topic


def test_dockerfile_builds_from_the_repository_as_a_non_root_user():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER (?!root)\w+", dockerfile, re.M)
    assert 'ENTRYPOINT ["instcls"]' in dockerfile
    for source in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), f"Dockerfile copies {path}, which is not in the repository"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "out", ".git"} <= set(ignored)


def test_training_pods_run_as_non_root_with_a_read_only_root_filesystem():
    pods = [d["spec"]["template"]["spec"] for _, d in all_documents() if d["kind"] == "Job"]
    pods += [replica["template"]["spec"] for _, d in all_documents() if d["kind"] == "PyTorchJob"
             for replica in d["spec"]["pytorchReplicaSpecs"].values()]
    assert len(pods) == 3
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 1000
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]
            assert context["capabilities"]["drop"] == ["ALL"]
            # Every place the job writes is an explicit volume.
            writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
            assert writable == {"/tmp", "/dev/shm", "/checkpoints"}
            assert {"name": "HOME", "value": "/tmp/home"} in container["env"]


def training_pods():
    pods = [d["spec"]["template"]["spec"] for _, d in all_documents() if d["kind"] == "Job"]
    pods += [replica["template"]["spec"] for _, d in all_documents() if d["kind"] == "PyTorchJob"
             for replica in d["spec"]["pytorchReplicaSpecs"].values()]
    assert len(pods) == 3
    return pods


def test_torchrun_waits_for_the_checkpoint_as_long_as_the_pod_may():
    # instcls launch turns INSTCLS_GRACE_PERIOD_S into torchrun's --shutdown-timeout (default 30 s).
    for pod in training_pods():
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["INSTCLS_GRACE_PERIOD_S"] == str(pod["terminationGracePeriodSeconds"])
        assert pod["containers"][0]["command"] == ["instcls", "launch"]


def test_training_pods_can_use_infiniband():
    # Without the RDMA device, IPC_LOCK and the NCCL settings, NCCL silently falls back to TCP
    # sockets across nodes: the job runs, many times slower in its collectives.
    for name in ("indexed-job.yaml", "pytorchjob.yaml"):
        text = (K8S / name).read_text()
        assert "PLACEHOLDER" in text and "WITHOUT InfiniBand" in text, name  # what to change is said
    for pod in training_pods():
        container = pod["containers"][0]
        resources = container["resources"]
        rdma = {key: value for key, value in resources["limits"].items() if key.startswith("rdma/")}
        assert rdma and all(resources["requests"][key] == value for key, value in rdma.items())
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_IB_HCA"] and env["NCCL_SOCKET_IFNAME"]
        assert env["NCCL_DEBUG"] == "WARN"


def pod_failure_action(policy: dict, container: str, exit_code: int, conditions: set[str]) -> str:
    """What the Job controller does with a failed pod (Kubernetes' podFailurePolicy: rules in order,
    the first match wins, none matching means Count)."""
    for rule in policy["rules"]:
        codes = rule.get("onExitCodes")
        if codes and codes.get("containerName", container) == container:
            if (exit_code in codes["values"]) == (codes["operator"] == "In"):
                return rule["action"]
        patterns = rule.get("onPodConditions", [])
        if any(p["type"] in conditions and p.get("status", "True") == "True" for p in patterns):
            return rule["action"]
    return "Count"


def test_the_indexed_job_retries_a_preemption_uncounted_and_fails_fast_on_a_permanent_code():
    """The codes the Job's rules name are the launcher's (``trainer.exit_codes``), read from the YAML."""
    from trainer.exit_codes import PERMANENT, RETRYABLE, ExitCode

    spec = next(d for _, d in all_documents() if d["kind"] == "Job")["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]["name"]
    policy = spec["podFailurePolicy"]
    assert pod["restartPolicy"] == "Never"  # what a podFailurePolicy and backoffLimitPerIndex require
    named = {code for rule in policy["rules"] for code in rule.get("onExitCodes", {}).get("values", [])}
    assert named == set(RETRYABLE) | set(PERMANENT)
    for code in ExitCode:
        if code == ExitCode.FINISHED:
            continue  # a pod that exits 0 has succeeded: no rule is asked
        expected = "Ignore" if code in RETRYABLE else "FailJob" if code in PERMANENT else "Count"
        assert pod_failure_action(policy, container, code, set()) == expected, code
        # A pod taken away (preemption, eviction, drain) is never held against the job.
        assert pod_failure_action(policy, container, code, {"DisruptionTarget"}) == "Ignore", code
    assert pod_failure_action(policy, container, 137, set()) == "Count"  # SIGKILLed with no disruption condition
    # Counted failures: a few per index, and one index out of them fails the gang (it cannot train without it).
    assert 1 <= spec["backoffLimitPerIndex"] <= 5 and spec["maxFailedIndexes"] == 0
    assert spec["podReplacementPolicy"] == "Failed"  # no replacement while the old pod still saves


def test_the_pytorchjob_restarts_on_exit_codes_that_kubeflow_retries():
    """Kubeflow's ExitCode policy recreates a pod that exited 128-255 and fails the job on 1-127."""
    from trainer.exit_codes import PERMANENT, RETRYABLE, ExitCode

    job = next(d for _, d in all_documents() if d["kind"] == "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {name: r["restartPolicy"] for name, r in replicas.items()} == {"Master": "ExitCode", "Worker": "ExitCode"}
    for code in set(ExitCode) - {ExitCode.FINISHED}:
        retried = 128 <= code <= 255
        assert retried == (code in RETRYABLE), code  # crashes too are permanent: these retries are never counted
    assert all(1 <= code <= 127 for code in PERMANENT)
