"""What `kubectl apply -k k8s/overlays/...` and the plain k8s/*.yaml files create validates offline,
ConfigMaps match the repository files, the dashboard only queries metrics the exporter serves, the
image definition is sane, and the pods land where they can run: GPU nodes with a new enough driver,
all of a job's pods at once, one image named in one place."""

import re

import jsonschema
import kubernetes_validate
import pytest
import tomllib
import yaml

from tests.helpers.crd_schemas import validate_closed, vendored
from tests.helpers.k8s_manifests import (
    K8S,
    OVERLAYS,
    ROOT,
    TRAINING_KINDS,
    TRAINING_POD_TEMPLATES,
    all_documents,
    dashboard_queries,
    is_training_job,
    pod_templates,
    rendered,
    training_pods,
)
from tests.helpers.manifest_validation import KUBERNETES_VERSION, VENDORED_CRDS, validate_manifest
from trainer.observability.metrics import METRIC_NAMES

# The oldest driver branch that runs each CUDA major version (NVIDIA's CUDA release notes and its
# data-center driver support matrix: R580 is the first branch with CUDA 13.x).
MIN_DRIVER_FOR_CUDA = {13: 580}
# The series a panel may query: each exported metric, and a histogram's _bucket/_sum/_count.
PANEL_METRICS = {*METRIC_NAMES, *(f"{histogram}_{part}" for part in ("bucket", "sum", "count")
                                  for histogram in ("instcls_step_duration_seconds", "instcls_shard_read_seconds"))}
# What the dashboard must show (the brief), as the PromQL that computes it.
_STEP = r"instcls_step_duration_seconds"
BRIEF_QUERIES = {
    "images/s": r"rate\(instcls_samples_processed_total\b",
    "step time p50": rf"histogram_quantile\(0\.5, .*rate\({_STEP}_bucket\b",
    "step time p95": rf"histogram_quantile\(0\.95, .*rate\({_STEP}_bucket\b",
    "data-loader wait share": rf"rate\(instcls_data_wait_seconds_total\b.*\) / .*rate\({_STEP}_sum\b",
    "loss": r"\binstcls_loss\b",
    "learning rate": r"\binstcls_learning_rate\b",
    "memory per rank": r"by \(pod, rank\b.*instcls_memory_bytes\b",
    "communication share": rf"rate\(instcls_classifier_comm_seconds_total\b.*\) / .*rate\({_STEP}_sum\b",
    "epoch progress": r"instcls_epoch\b.*\+ .*instcls_epoch_progress_ratio\b",
    "eta": rf"instcls_epochs_planned\b.*instcls_steps_per_epoch\b.*{_STEP}_sum\b",
    "knn accuracy": r"\binstcls_eval_knn_accuracy\b",
    "step time by phase": r"sum by \(phase\) \(rate\(instcls_step_phase_seconds_total\b",
    "shard read latency p99": r"histogram_quantile\(0\.99, .*rate\(instcls_shard_read_seconds_bucket\b",
    "shard read retries": r"rate\(instcls_shard_read_retries_total\b",
}


def test_every_manifest_validates():
    kinds = set()
    assert {"indexed-job", "pytorchjob", "make-shards"} <= set(OVERLAYS)
    for _, document in all_documents():
        kinds.add(document["kind"])
        validate_manifest(document)  # custom resources: the real CRD schema, every object closed
    assert {"Job", "Service", "ConfigMap", "PersistentVolumeClaim", "PodMonitor", "PyTorchJob", "TrainJob",
            "ClusterTrainingRuntime"} <= kinds


def test_validation_catches_a_broken_manifest():
    _, job = next((n, d) for n, d in all_documents() if is_training_job(d))
    job["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "not-a-port"
    with pytest.raises(kubernetes_validate.ValidationError, match="'not-a-port' is not of type 'integer'"):
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)
    monitor = next(d for _, d in all_documents() if d["kind"] == "PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "often"  # not a Prometheus duration
    with pytest.raises(jsonschema.ValidationError, match="'often' does not match"):
        validate_closed(monitor, vendored(VENDORED_CRDS["PodMonitor"])["openAPIV3Schema"])
    pytorchjob = next(d for _, d in all_documents() if d["kind"] == "PyTorchJob")
    pytorchjob["spec"]["runPolicy"]["backofLimit"] = 3  # misspelled: an open schema would take it
    with pytest.raises(jsonschema.ValidationError, match="backofLimit"):
        validate_closed(pytorchjob, vendored(VENDORED_CRDS["PyTorchJob"])["openAPIV3Schema"])


def test_training_pods_have_what_the_job_needs():
    job = next(d for _, d in all_documents() if is_training_job(d))
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


def test_dashboard_queries_only_exported_metrics_and_covers_the_brief():
    dashboard, queries = dashboard_queries()
    used = set()
    for query in queries:
        for name in re.findall(r"instcls_[a-z_]+", query):
            histogram = "step_duration_seconds" in name or "shard_read_seconds" in name
            used.add(re.sub(r"_(bucket|sum|count)$", "", name) if histogram else name)
    assert used and used <= set(METRIC_NAMES), used - set(METRIC_NAMES)
    # Every panel queries something: each of its expressions names an exported metric.
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert set(re.findall(r"instcls_[a-z_]+", target["expr"])) & set(PANEL_METRICS), target["expr"]
    # The brief, by what a panel computes (its metric and PromQL), not by what its title says.
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for topic, pattern in BRIEF_QUERIES.items():
        assert any(re.search(pattern, expr) for expr in expressions), topic


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
    for pod in training_pods():
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 1000
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]
            assert context["capabilities"]["drop"] == ["ALL"]
            # Every place the job writes is an explicit volume.
            writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
            assert writable == {"/tmp", "/dev/shm", "/checkpoints"}
            assert {"name": "HOME", "value": "/tmp/home"} in container["env"]


def test_torchrun_waits_for_the_checkpoint_as_long_as_the_pod_may():
    # instcls launch turns INSTCLS_GRACE_PERIOD_S into torchrun's --shutdown-timeout (default 30 s).
    for pod in training_pods():
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["INSTCLS_GRACE_PERIOD_S"] == str(pod["terminationGracePeriodSeconds"])
        assert pod["containers"][0]["command"] == ["instcls", "launch"]


def test_training_pods_can_use_infiniband():
    # Without the RDMA device, IPC_LOCK and the NCCL settings, NCCL silently falls back to TCP
    # sockets across nodes: the job runs, many times slower in its collectives.
    for name in ("indexed-job/indexed-job.yaml", "pytorchjob/pytorchjob.yaml"):
        text = (K8S / "overlays" / name).read_text()
        assert "PLACEHOLDER" in text and "k8s/nccl-fabric.yaml" in text, name  # what to change, and where
    fabric = yaml.safe_load((K8S / "nccl-fabric.yaml").read_text())
    text = (K8S / "nccl-fabric.yaml").read_text()
    assert "PLACEHOLDER" in text and "WITHOUT InfiniBand" in text and "RoCE" in text
    # exact HCA names ("=" first, each with its port): a bare prefix also matches storage and front-end ports
    hcas = fabric["data"]["NCCL_IB_HCA"]
    assert hcas.startswith("=") and all(":" in hca for hca in hcas[1:].split(","))
    assert fabric["data"]["NCCL_IB_DISABLE"] == "0" and fabric["data"]["NCCL_SOCKET_IFNAME"]
    for pod in training_pods():
        container = pod["containers"][0]
        resources = container["resources"]
        rdma = {key: value for key, value in resources["limits"].items() if key.startswith("rdma/")}
        assert rdma and all(resources["requests"][key] == value for key, value in rdma.items())
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        # the fabric from the one ConfigMap, never set again inline (an inline value would win over it)
        assert container["envFrom"] == [{"configMapRef": {"name": fabric["metadata"]["name"]}}]
        assert not set(env) & set(fabric["data"]), set(env) & set(fabric["data"])
        assert env["NCCL_DEBUG"] == "WARN"


def pod_failure_action(policy: dict, container: str, exit_code: int, conditions: set[str]) -> str:
    """What the Job controller does with a failed pod (Kubernetes' podFailurePolicy: rules in order,
    the first match wins, none matching means Count)."""
    for rule in policy["rules"]:
        codes = rule.get("onExitCodes")
        if (codes and codes.get("containerName", container) == container
                and (exit_code in codes["values"]) == (codes["operator"] == "In")):
            return rule["action"]
        patterns = rule.get("onPodConditions", [])
        if any(p["type"] in conditions and p.get("status", "True") == "True" for p in patterns):
            return rule["action"]
    return "Count"


def test_the_rendezvous_service_resolves_pods_before_they_are_ready():
    """torchrun's c10d store starts on pod 0 while that pod is not Ready; a headless Service publishes
    only Ready addresses unless told otherwise, and the first rendezvous could time out resolving it."""
    services = [d for _, d in all_documents() if d.get("kind") == "Service"]
    assert services
    for service in services:
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True


def test_the_indexed_job_retries_a_preemption_uncounted_and_fails_fast_on_a_permanent_code():
    """The codes the Job's rules name are the launcher's (``trainer.exit_codes``), read from the YAML."""
    from trainer.exit_codes import PERMANENT, RETRYABLE, ExitCode

    spec = next(d for _, d in all_documents() if is_training_job(d))["spec"]
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
    from trainer.exit_codes import PERMANENT, RECREATED, RETRYABLE, ExitCode

    job = next(d for _, d in all_documents() if d["kind"] == "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {name: r["restartPolicy"] for name, r in replicas.items()} == {"Master": "ExitCode", "Worker": "ExitCode"}
    for code in set(ExitCode) - {ExitCode.FINISHED}:
        retried = 128 <= code <= 255
        # crashes too are permanent (these retries are never counted); a lost store host is recreated
        assert retried == (code in RETRYABLE | RECREATED), code
    assert all(1 <= code <= 127 for code in PERMANENT)


def test_the_image_is_named_in_one_place():
    """Every pod of every overlay runs the image k8s/base names; the workloads say only `instcls`."""
    base = yaml.safe_load((K8S / "base/kustomization.yaml").read_text())
    assert base["kind"] == "Component"
    (image,) = base["images"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert image["name"] == "instcls" and image["newTag"] == version  # the image is tagged with the package's version
    expected = f"{image['newName']}:{image['newTag']}"
    for overlay in OVERLAYS:
        assert "../../base" in yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())[
            "components"], overlay
        templates = [template for document in rendered(overlay) for template in pod_templates(document)]
        assert templates, overlay
        for template in templates:
            assert {c["image"] for c in template["spec"]["containers"]} == {expected}, overlay
    for path in (K8S / "overlays").glob("*/*.yaml"):  # the workload files themselves name no registry or tag
        assert set(re.findall(r"^\s+image: (\S+)", path.read_text(), re.M)) <= {"instcls"}, path


def test_gpu_pods_run_only_on_gpu_nodes_whose_driver_runs_the_images_cuda():
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    cuda_major = int(next(re.search(r"nvidia-dali-cuda(\d+)0\b", pin)[1] for pin in pins if "nvidia-dali-cuda" in pin))
    assert cuda_major in MIN_DRIVER_FOR_CUDA, f"the image now uses CUDA {cuda_major}: add its minimum driver here, " \
        "then to the manifests and k8s/README.md"
    driver = MIN_DRIVER_FOR_CUDA[cuda_major]
    templates = [t for _, d in all_documents() if is_training_job(d) or d["kind"] in TRAINING_KINDS
                 for t in pod_templates(d)]
    assert len(templates) == TRAINING_POD_TEMPLATES
    for template in templates:
        pod = template["spec"]
        assert template["metadata"]["annotations"]["instcls/min-nvidia-driver"] == str(driver)
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert {"key": "nvidia.com/cuda.driver.major", "operator": "Gt", "values": [str(driver - 1)]} in \
            term["matchExpressions"]  # Gt is strict: major > driver - 1
        assert pod["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert f"{driver}" in re.search(r"^## GPU nodes.*?(?=^## )", (K8S / "README.md").read_text(), re.M | re.S)[0]
    # Pods that need no GPU neither ask for one nor tolerate the GPU nodes' taint.
    for _, document in all_documents():
        if document["kind"] == "Job" and not is_training_job(document):
            for template in pod_templates(document):
                assert "tolerations" not in template["spec"] and "nodeSelector" not in template["spec"]
                assert not any("nvidia.com/gpu" in str(c["resources"]) for c in template["spec"]["containers"])


def test_training_jobs_are_admitted_all_at_once_by_kueue():
    """Gang scheduling: both training kinds carry Kueue's queue label (the same queue), and neither
    is created suspended, so that without Kueue they still run."""
    jobs = [d for _, d in all_documents() if is_training_job(d) or d["kind"] == "PyTorchJob"]
    assert sorted(d["kind"] for d in jobs) == ["Job", "Job", "PyTorchJob", "PyTorchJob"]  # each fixed and elastic
    assert len({d["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] for d in jobs}) == 1
    for job in jobs:
        assert job["spec"].get("suspend") is not True and job["spec"].get("runPolicy", {}).get("suspend") is not True
        # Kueue alone: the training-operator's own gang scheduling would need a second scheduler.
        assert "schedulingPolicy" not in job["spec"].get("runPolicy", {})


def test_every_fsgroup_skips_the_recursive_chown():
    """fsGroup alone makes the kubelet chown every file of a volume at each pod start (hours on a
    500 Gi checkpoint volume); OnRootMismatch only when the volume's root is not the group's yet."""
    contexts = [t["spec"]["securityContext"] for _, d in all_documents() for t in pod_templates(d)]
    assert len(contexts) == TRAINING_POD_TEMPLATES + 2  # the training pods, make-shards parts and merge
    for context in contexts:
        assert context["fsGroup"] == 1000 and context["fsGroupChangePolicy"] == "OnRootMismatch"


def test_deleting_an_overlay_never_deletes_data():
    """`kubectl delete -k k8s/overlays/X` deletes what the overlay renders: no volume claim among it."""
    for overlay in OVERLAYS:
        assert not [d for d in rendered(overlay) if d["kind"] in ("PersistentVolumeClaim", "PersistentVolume")], overlay
    claims = {d["metadata"]["name"] for _, d in all_documents() if d["kind"] == "PersistentVolumeClaim"}
    assert {"instcls-shards", "instcls-checkpoints"} <= claims


ELASTIC_BATCH = "--set=data.loader.batch_size=105"


def test_the_elastic_overlays_change_only_the_node_count_and_the_rendezvous():
    """The elastic forms run the same pods as the fixed ones; what differs is how many nodes the
    rendezvous takes (MIN:MAX, MAX the fixed job's size), how many restarts (every membership
    change counts) and, for the Indexed Job, when it is done (MIN indexes succeeded)."""
    def only(overlay, kind):
        (document,) = [d for d in rendered(overlay) if d["kind"] == kind]
        return document

    fixed, elastic = only("pytorchjob", "PyTorchJob"), only("pytorchjob-elastic", "PyTorchJob")
    policy = elastic["spec"]["elasticPolicy"]
    replicas = fixed["spec"]["pytorchReplicaSpecs"]
    assert policy["rdzvBackend"] == "c10d" and policy["maxRestarts"] >= 50
    assert 1 <= policy["minReplicas"] < policy["maxReplicas"] == sum(r["replicas"] for r in replicas.values())
    assert list(elastic["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    worker = elastic["spec"]["pytorchReplicaSpecs"]["Worker"]
    elastic_args = worker["template"]["spec"]["containers"][0]["args"]
    assert elastic_args[-1] == ELASTIC_BATCH  # the one change to the pods: a batch every size splits
    # and the fixed job's rendezvous flags, which would override the elasticPolicy's PET_* variables
    fixed_args = replicas["Master"]["template"]["spec"]["containers"][0]["args"]
    rendezvous = ("--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--max-restarts")
    assert [a for a in fixed_args if a.split("=")[0] in rendezvous] == fixed_args[:len(rendezvous)]
    assert not [a for a in elastic_args if a.split("=")[0] in rendezvous]
    assert elastic_args[:-1] == fixed_args[len(rendezvous):]
    worker["template"]["spec"]["containers"][0]["args"] = fixed_args
    assert worker["replicas"] == policy["maxReplicas"] and worker["template"] == replicas["Master"]["template"]
    conf = {entry["key"]: int(entry["value"]) for entry in policy["rdzvConf"]}
    assert conf["last_call_timeout"] >= 60 and conf["join_timeout"] >= conf["last_call_timeout"]

    fixed, elastic = only("indexed-job", "Job"), only("indexed-job-elastic", "Job")
    args = {a.split("=", 1)[0]: a for a in elastic["spec"]["template"]["spec"]["containers"][0]["args"]}
    low, high = map(int, args["--nnodes"].split("=")[1].split(":"))
    assert low < high == fixed["spec"]["completions"]
    assert int(args["--max-restarts"].split("=")[1]) >= 50 and "last_call_timeout=" in args["--rdzv-conf"]
    assert elastic["spec"]["successPolicy"] == {"rules": [{"succeededCount": low}]}
    assert args["--set"] == ELASTIC_BATCH
    unchanged = [a for a in elastic["spec"]["template"]["spec"]["containers"][0]["args"]
                 if not a.startswith(("--nnodes", "--max-restarts", "--rdzv-conf")) and a != ELASTIC_BATCH]
    assert unchanged == [a for a in fixed["spec"]["template"]["spec"]["containers"][0]["args"]
                         if not a.startswith(("--nnodes", "--max-restarts"))]
    elastic["spec"]["template"]["spec"]["containers"][0]["args"] = fixed["spec"]["template"]["spec"]["containers"][0][
        "args"]
    assert elastic["spec"]["template"] == fixed["spec"]["template"]
