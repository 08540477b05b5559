"""The pod drills' harness without starting a pod: the kubelet's ``$(VAR)`` expansion, the
controllers' verdicts played from the shipped manifests' policies, the CPU substitutions (and
nothing else) applied to each overlay's own command, and the refusals that name the field."""

import copy
import types

import pytest

from trainer.drills.pods import cpu_substitutions as cpu
from trainer.drills.pods import local_cluster
from trainer.drills.pods.controllers import Action, PodEnd, controller_of
from trainer.drills.pods.cpu_job import job_config_map, nccl_config_map
from trainer.drills.pods.local_cluster import LocalCluster
from trainer.drills.pods.manifest import ManifestError, render, workload
from trainer.drills.pods.pod_environment import command_line, container_environment, expand

MULTI_NODE = ("indexed-job", "indexed-job-elastic", "pytorchjob", "pytorchjob-elastic", "trainjob")
# 8 nodes of 8 processes become 2 of 1, an elastic 4:8 becomes 1:2 with a batch both sizes split
RESIZED = {"--nnodes=8": "--nnodes=2", "--nnodes=4:8": "--nnodes=1:2", "--nproc-per-node=8": "--nproc-per-node=1",
           "--set=data.loader.batch_size=105": "--set=data.loader.batch_size=64"}


def test_the_kubelets_expansion():
    env = {"A": "x", "B": "y"}
    assert expand("--e=$(A):$(B)", env) == "--e=x:y"
    assert expand("$(MISSING) stays", env) == "$(MISSING) stays"  # an unknown name is left as written
    assert expand("$$(A) $$ $", env) == "$(A) $ $"  # $$ escapes
    assert expand("$(A", env) == "$(A"  # unterminated


def test_env_values_see_only_the_variables_before_them():
    container = {"env": [{"name": "LATER_USE", "value": "$(FIRST)-$(SECOND)"}, {"name": "FIRST", "value": "1"},
                         {"name": "SECOND", "value": "$(FIRST)2"}],
                 "envFrom": [{"configMapRef": {"name": "fabric"}}]}
    env = container_environment("pod", container, [{"name": "INJECTED", "value": "$(SECOND)"}], "p", {}, {},
                                {"fabric": {"FROM_MAP": "m"}}, {})
    assert env == {"FROM_MAP": "m", "LATER_USE": "$(FIRST)-$(SECOND)", "FIRST": "1", "SECOND": "12",
                   "INJECTED": "12"}


def _verdicts(overlay: str, ends: list[PodEnd]) -> list[Action]:
    controller = controller_of(workload(overlay))
    return [controller.judge(end).action for end in ends]


def test_the_indexed_jobs_policy_from_its_manifest():
    assert _verdicts("indexed-job", [PodEnd(1, 143), PodEnd(1, 137, disrupted=True), PodEnd(1, 1, disrupted=True)]) \
        == [Action.REPLACE] * 3  # a stop and anything disrupted: not counted
    assert _verdicts("indexed-job", [PodEnd(0, code) for code in (2, 3, 4)]) == [Action.FAIL_JOB] * 3
    # backoffLimitPerIndex 3: the fourth counted failure of one index fails the Job (maxFailedIndexes 0)
    assert _verdicts("indexed-job", [PodEnd(1, 137)] * 4) == [Action.REPLACE_COUNTED] * 3 + [Action.FAIL_JOB]


def test_the_trainjobs_jobset_fails_on_a_permanent_code_and_restarts_otherwise():
    assert _verdicts("trainjob", [PodEnd(0, 2)]) == [Action.FAIL_JOB]  # FailJobSet on PodFailurePolicy
    # an index that used up its retries fails the Job for another reason: the JobSet restarts, 3 times
    assert _verdicts("trainjob", [PodEnd(0, 1)] * 4 * 4) == \
        ([Action.REPLACE_COUNTED] * 3 + [Action.RESTART_ALL]) * 3 + [Action.REPLACE_COUNTED] * 3 + [Action.FAIL_JOB]


def test_the_pytorchjobs_exit_code_policy():
    assert _verdicts("pytorchjob", [PodEnd(1, 137), PodEnd(1, 143), PodEnd(1, 1), PodEnd(1, 1, deleted=True)]) == \
        [Action.REPLACE, Action.REPLACE, Action.FAIL_JOB, Action.REPLACE]


def test_success_follows_each_controller():
    job = controller_of(workload("indexed-job-elastic", _scaled("indexed-job-elastic")[0]))
    job.judge(PodEnd(0, 0))
    assert job.done(2)  # successPolicy: MIN (1 here) indexes suffice
    fixed = controller_of(workload("indexed-job"))
    fixed.judge(PodEnd(0, 0))
    assert not fixed.done(2)
    master = controller_of(workload("pytorchjob"))
    master.judge(PodEnd(1, 0))
    assert not master.done(2)  # a worker alone does not end a job that has a master
    master.judge(PodEnd(0, 0))
    assert master.done(2)


def _scaled(overlay: str) -> tuple[list[dict], cpu.Changes]:
    changes = cpu.Changes()
    objects = render(overlay)
    cpu.scale_objects(objects, changes)
    return objects, changes


def _cluster(overlay: str, tmp_path, objects=None, config_maps=None) -> LocalCluster:
    scaled, changes = _scaled(overlay)
    maps = {"instcls-job": job_config_map(), "instcls-nccl": nccl_config_map()} if config_maps is None else config_maps
    return LocalCluster(workload(overlay, scaled if objects is None else objects), tmp_path, changes, maps,
                        elastic_batch=64)


@pytest.mark.parametrize("overlay", MULTI_NODE)
def test_each_overlay_runs_its_own_command_with_only_the_listed_substitutions(overlay, tmp_path, monkeypatch):
    started = []
    _no_processes(monkeypatch, started)
    cluster = _cluster(overlay, tmp_path)
    cluster.start_all()
    assert len(started) == 2  # 8 nodes become 2
    pod = cluster.workload.pods[1]
    env = container_environment("pod", pod.container, pod.injected, pod.name, pod.annotations, {},
                                cluster.config_maps, {})
    shipped = command_line("pod", pod.container, env)
    argv, kw = started[1]
    # what stays: every argument the manifest gives, in order, but for the listed rewrites
    local = list(cluster.endpoints.values())[0]
    rewritten = [cpu.rewrite_paths(a, {"/etc/instcls": "mnt/etc/instcls"}) for a in shipped[1:]]
    rewritten = [a.replace(endpoint, local) for a in rewritten for endpoint in [list(cluster.endpoints)[0]]]
    rewritten = [RESIZED.get(a, a) for a in rewritten]
    assert argv[3:3 + len(rewritten)] == rewritten
    assert argv[3 + len(rewritten):] == [a for a in argv if a.startswith(("--set=logging.metrics_port=",
                                                                        "--set=parallel.collective_timeout_s="))]
    child = kw["env"]
    assert child["OMP_NUM_THREADS"] == "1"
    assert child.get("PET_NPROC_PER_NODE", "1") == "1"
    assert child["INSTCLS_GRACE_PERIOD_S"] == "600"  # the grace period and shutdown timeout stay
    assert child["INSTCLS_IMAGE"] == pod.container["image"]  # what run.json records: the image as rendered
    assert child["HOME"].startswith(str(tmp_path)) and child["TMPDIR"].startswith(str(tmp_path))
    assert "NCCL_IB_HCA" in child or "NCCL_SOCKET_IFNAME" in child  # the fabric ConfigMap, as shipped
    log = (tmp_path / "changes.txt").read_text()
    assert any(size in log.splitlines()[0] for size in ("completions 8 -> 2", "replicas 7 -> 1", "replicas 8 -> 2",
                                                        "numNodes 8 -> 2")), log
    assert f"{list(cluster.endpoints)[0]} -> {local}" in log


class _NoProcess:
    pid = 0

    def poll(self):
        return None


def _no_processes(monkeypatch, started: list | None = None) -> None:
    """Pods that are never started: their command and environment recorded instead."""
    def popen(argv, **kw):
        if started is not None:
            started.append((argv, kw))
        return _NoProcess()
    monkeypatch.setattr(local_cluster, "subprocess", types.SimpleNamespace(Popen=popen, STDOUT=None))


def test_a_command_the_harness_does_not_know_is_refused(tmp_path, monkeypatch):
    _no_processes(monkeypatch)
    objects, _ = _scaled("indexed-job")
    job = next(obj for obj in objects if obj["kind"] == "Job")
    job["spec"]["template"]["spec"]["containers"][0]["command"] = ["torchrun"]
    with pytest.raises(ManifestError, match=r"command 'torchrun' is not a command the harness knows"):
        _cluster("indexed-job", tmp_path, objects).start(0)


@pytest.mark.parametrize(("where", "edit", "message"), [
    ("envFrom", lambda c: c["envFrom"].append({"secretRef": {"name": "nccl-keys"}}),
     r"envFrom\[1\]\.secretRef: 'nccl-keys' is not among the fixtures"),
    ("env", lambda c: c["env"].append({"name": "LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "cpu"}}}),
     r"env\[\d+\] \(LIMIT\)\.valueFrom: \['resourceFieldRef'\] is not a source"),
    ("fieldRef", lambda c: c["env"].append({"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}),
     r"fieldPath metadata\.uid is not one the harness supplies"),
])
def test_a_variable_from_a_source_it_cannot_supply_is_refused(where, edit, message, tmp_path, monkeypatch):
    _no_processes(monkeypatch)
    objects, _ = _scaled("indexed-job")
    edit(next(obj for obj in objects if obj["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0])
    with pytest.raises(ManifestError, match=message):
        _cluster("indexed-job", tmp_path, objects).start(0)


def test_a_volume_or_config_map_it_cannot_supply_is_refused(tmp_path, monkeypatch):
    _no_processes(monkeypatch)
    with pytest.raises(ManifestError, match=r"ConfigMap 'instcls-job' is not among the fixtures"):
        _cluster("trainjob", tmp_path / "a", config_maps={"instcls-nccl": nccl_config_map()}).start(0)
    objects, _ = _scaled("indexed-job")
    spec = next(obj for obj in objects if obj["kind"] == "Job")["spec"]["template"]["spec"]
    spec["volumes"] = copy.deepcopy(spec["volumes"]) + [{"name": "nfs", "nfs": {"server": "x", "path": "/"}}]
    spec["containers"][0]["volumeMounts"].append({"name": "nfs", "mountPath": "/nfs"})
    with pytest.raises(ManifestError, match=r"volumeMounts nfs: volume kind \['nfs'\] is not one the harness supplies"):
        _cluster("indexed-job", tmp_path / "b", objects).start(0)


def test_only_the_pod_the_endpoint_names_hosts_an_elastic_pytorchjobs_store(tmp_path, monkeypatch):
    """torch picks the c10d store's host by matching the endpoint's name with its own; on one machine
    every pod matches 127.0.0.1, so the harness says which pod the name belongs to."""
    started = []
    _no_processes(monkeypatch, started)
    cluster = _cluster("pytorchjob-elastic", tmp_path)
    cluster.start_all()
    assert [kw["env"]["PET_RDZV_CONF"].split(",")[-1] for _, kw in started] == ["is_host=1", "is_host=0"]
    assert "join_timeout=780" in started[1][1]["env"]["PET_RDZV_CONF"]  # the manifest's conf stays


def test_a_trainjobs_pods_get_the_status_servers_variables_when_a_test_serves_it(tmp_path, monkeypatch):
    started = []
    _no_processes(monkeypatch, started)
    scaled, changes = _scaled("trainjob")
    server = {"KUBEFLOW_TRAINER_SERVER_URL": "https://127.0.0.1:8443/status", "KUBEFLOW_TRAINER_SERVER_TOKEN": "/t"}
    cluster = LocalCluster(workload("trainjob", scaled), tmp_path, changes,
                           {"instcls-job": job_config_map(), "instcls-nccl": nccl_config_map()}, status_server=server)
    cluster.start(0)
    assert {k: started[0][1]["env"][k] for k in server} == server
    with pytest.raises(ManifestError, match="only a TrainJob's pods get a status endpoint"):
        LocalCluster(workload("indexed-job"), tmp_path / "b", changes, {}, status_server=server)


def test_a_job_that_lets_an_index_fail_alone_is_refused():
    """An index out of retries that ends alone while the others train is no policy for a gang of
    nodes, and not one the harness plays."""
    objects, _ = _scaled("indexed-job")
    next(obj for obj in objects if obj["kind"] == "Job")["spec"]["maxFailedIndexes"] = 1
    with pytest.raises(ManifestError, match=r"maxFailedIndexes=1: the harness plays 0 only"):
        workload("indexed-job", objects)
