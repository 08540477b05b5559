"""The training pods an overlay asks for, read from the overlay as rendered, and what the controller
that owns them adds to each: its environment variables, its name and its DNS name.

Rendering: ``kubectl kustomize`` where kubectl is installed, ``k8s/render_overlay.py`` otherwise
(tests/unit/test_k8s_render.py holds the two to the same objects).  Three workload kinds, each with
the sources it follows:

- an Indexed ``batch/v1`` Job: the Job controller (Kubernetes 1.33) names pod I ``JOB-I`` (its
  hostname; ``JOB-I.SUBDOMAIN`` through the headless service), annotates it with
  ``batch.kubernetes.io/job-completion-index`` and sets ``JOB_COMPLETION_INDEX`` unless the
  container already does;
- a Kubeflow ``PyTorchJob``: training-operator v1.9.0, ``pkg/controller.v1/pytorch``: ``envvar.go``
  (``PYTHONUNBUFFERED``, ``WORLD_SIZE``, ``RANK``, ``PET_NNODES``, ``PET_NODE_RANK``,
  ``PET_NPROC_PER_NODE``), ``master.go`` (``MASTER_ADDR``/``MASTER_PORT``, and their ``PET_`` twins),
  ``elastic.go`` (``PET_RDZV_*``, ``PET_NNODES=MIN:MAX``, ``PET_MAX_RESTARTS``); pods
  ``JOB-master-0`` and ``JOB-worker-I``, the port the container names ``pytorchjob-port`` (the
  webhook's default 23456 when none does);
- a Kubeflow Trainer v2 ``TrainJob`` on the ``ClusterTrainingRuntime`` it names: Trainer v2.3.0's
  torch plugin (``pkg/runtime/framework/plugins/torch/torch.go``) sets ``PET_NNODES``,
  ``PET_NPROC_PER_NODE`` (``auto`` with a GPU limit), ``PET_NODE_RANK`` (the completion index),
  ``PET_MASTER_ADDR=TRAINJOB-node-0-0.TRAINJOB`` and ``PET_MASTER_PORT=29500``; JobSet names pod I of
  the ``node`` Job ``TRAINJOB-node-0-I``.
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
import subprocess
from dataclasses import dataclass, field

import yaml

from trainer.drills.jobs import REPO

K8S = REPO / "k8s"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
PYTORCHJOB_PORT = ("pytorchjob-port", 23456)  # training-operator's default port name and number
TRAINJOB_PORT = 29500  # Trainer v2.3.0's constants.ContainerTrainerPort
GPU_RESOURCE = "nvidia.com/gpu"


class ManifestError(ValueError):
    """The overlay asks for something the harness cannot run; the message names the field."""


@dataclass(frozen=True)
class PodTemplate:
    """One pod of the workload, as its controller creates it."""

    role: str  # "node" (Job, TrainJob), "master" or "worker" (PyTorchJob)
    index: int  # completion index, or replica index within the role
    name: str  # the pod's hostname
    dns_name: str  # what the other pods reach it by
    spec: dict  # the pod template's spec, as rendered
    container: dict  # the training container (the one the controller injects into)
    annotations: dict[str, str]
    injected: list[dict] = field(default_factory=list)  # the controller's env entries, appended after the container's


@dataclass(frozen=True)
class Workload:
    overlay: str
    kind: str  # Job, PyTorchJob, TrainJob
    name: str
    pods: list[PodTemplate]
    policy: dict  # what the controller acts on (see trainer.drills.pods.controllers)
    ports: dict[str, int]  # cluster "host:port" endpoints the pods use, each to be mapped to loopback


def render(overlay: str) -> list[dict]:
    """The objects ``kubectl apply -k k8s/overlays/OVERLAY`` would create."""
    directory = K8S / "overlays" / overlay
    if not directory.is_dir():
        raise ManifestError(f"k8s/overlays/{overlay} does not exist: pick one of "
                            f"{sorted(p.name for p in (K8S / 'overlays').iterdir())}")
    if shutil.which("kubectl"):
        result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise ManifestError(f"kubectl kustomize k8s/overlays/{overlay} failed: {result.stderr.strip()}")
        return [document for document in yaml.safe_load_all(result.stdout) if document]
    spec = importlib.util.spec_from_file_location("render_overlay", K8S / "render_overlay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render(directory)


def workload(overlay: str, objects: list[dict] | None = None) -> Workload:
    """The training workload of ``overlay`` (its Job, PyTorchJob or TrainJob) and its pods."""
    objects = copy.deepcopy(render(overlay) if objects is None else objects)
    for kind, read in (("TrainJob", _trainjob), ("PyTorchJob", _pytorchjob), ("Job", _indexed_job)):
        found = [obj for obj in objects if obj.get("kind") == kind]
        if found:
            return read(overlay, found[0], objects)
    raise ManifestError(f"k8s/overlays/{overlay}: no Job, PyTorchJob or TrainJob to run (kinds: "
                        f"{sorted({obj.get('kind') for obj in objects})})")


def _container(where: str, spec: dict, name: str | None = None) -> dict:
    containers = spec.get("containers") or []
    if name is not None:
        containers = [c for c in containers if c.get("name") == name]
    if len(containers) != 1:
        raise ManifestError(f"{where}.containers: expected one training container"
                            + (f" named {name!r}" if name else "") + f", found {len(containers)}")
    if spec.get("initContainers"):
        raise ManifestError(f"{where}.initContainers: init containers are not run by the harness; remove them")
    return containers[0]


def _job_pods(where: str, job_spec: dict, name: str, dns_domain: str, count: int, container_name: str | None,
              injected) -> list[PodTemplate]:
    template = job_spec["template"]
    pods = []
    for index in range(count):
        spec = template["spec"]
        annotations = {**template.get("metadata", {}).get("annotations", {}), COMPLETION_INDEX_ANNOTATION: str(index)}
        container = _container(f"{where}.template.spec", spec, container_name)
        own = [{"name": "JOB_COMPLETION_INDEX", "value": str(index)}]  # the Job controller's, unless the pod sets it
        pods.append(PodTemplate("node", index, f"{name}-{index}", f"{name}-{index}.{dns_domain}", spec, container,
                                annotations, [*injected(index), *own]))
    return pods


def _job_policy(job_spec: dict) -> dict:
    if job_spec.get("backoffLimitPerIndex") is not None and job_spec.get("maxFailedIndexes", 0) != 0:
        # an index out of retries would end alone while the others go on: a gang job never wants it
        raise ManifestError(f"Job spec.maxFailedIndexes={job_spec['maxFailedIndexes']}: the harness plays 0 only (one "
                            "failed index fails the Job, as a gang of nodes needs)")
    keys = ("podFailurePolicy", "backoffLimitPerIndex", "maxFailedIndexes", "backoffLimit", "podReplacementPolicy",
            "successPolicy", "completions", "parallelism", "completionMode")
    return {key: job_spec[key] for key in keys if key in job_spec}


def _indexed_job(overlay: str, job: dict, objects: list[dict]) -> Workload:
    name, spec = job["metadata"]["name"], job["spec"]
    if spec.get("completionMode") != "Indexed":
        raise ManifestError(f"k8s/overlays/{overlay}: Job {name} spec.completionMode must be Indexed (one pod per "
                            "node)")
    subdomain = spec["template"]["spec"].get("subdomain")
    if not subdomain:
        raise ManifestError(f"k8s/overlays/{overlay}: Job {name} spec.template.spec.subdomain is unset: the pods "
                            "cannot reach pod 0 by name")
    pods = _job_pods(f"Job {name} spec", spec, name, subdomain, spec["completions"], None, lambda index: [])
    ports = {f"{pod.dns_name}:{port['containerPort']}": port["containerPort"] for pod in pods
             for port in pod.container.get("ports", []) if port.get("name") == "rendezvous"}
    return Workload(overlay, "Job", name, pods, {"job": _job_policy(spec)}, ports)


def _pytorchjob(overlay: str, job: dict, objects: list[dict]) -> Workload:
    name, spec = job["metadata"]["name"], job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    elastic = spec.get("elasticPolicy")
    unknown = set(replicas) - {"Master", "Worker"}
    if unknown:
        raise ManifestError(f"k8s/overlays/{overlay}: PyTorchJob {name} spec.pytorchReplicaSpecs has "
                            f"{sorted(unknown)}: only Master and Worker are run")
    roles = [(role.lower(), replicas[role]) for role in ("Master", "Worker") if role in replicas]
    total = sum(r["replicas"] for _, r in roles)
    nproc = str(spec.get("nprocPerNode", "auto"))

    def port_of(replica: dict) -> int:
        container = _container(f"PyTorchJob {name} {replica}", replica["template"]["spec"], "pytorch")
        return next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == PYTORCHJOB_PORT[0]),
                    PYTORCHJOB_PORT[1])

    master_port = port_of(replicas["Master"]) if "Master" in replicas else None
    worker_port = port_of(replicas["Worker"]) if "Worker" in replicas else None
    pods, ports = [], {}
    for role, replica in roles:
        if replica.get("restartPolicy") != "ExitCode":
            raise ManifestError(f"k8s/overlays/{overlay}: PyTorchJob {name} {role} restartPolicy "
                                f"{replica.get('restartPolicy')!r}: the harness plays ExitCode only")
        for index in range(replica["replicas"]):
            rank = index + (1 if role == "worker" and "Master" in replicas else 0)
            env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
            if "Master" in replicas:
                master = f"{name}-master-0"
                ports[f"{master}:{master_port}"] = master_port
                env += [{"name": "MASTER_PORT", "value": str(master_port)}, {"name": "MASTER_ADDR", "value": master},
                        {"name": "PET_MASTER_PORT", "value": str(master_port)},
                        {"name": "PET_MASTER_ADDR", "value": master},
                        {"name": "WORLD_SIZE", "value": str(total)}, {"name": "RANK", "value": str(rank)},
                        {"name": "PET_NPROC_PER_NODE", "value": nproc}, {"name": "PET_NODE_RANK", "value": str(rank)}]
            if elastic is not None:
                endpoint = f"{name}-worker-0:{worker_port}"
                ports[endpoint] = worker_port
                env += [{"name": "PET_RDZV_ENDPOINT", "value": endpoint},
                        {"name": "PET_RDZV_BACKEND", "value": elastic.get("rdzvBackend", "c10d")},
                        {"name": "PET_NNODES", "value": f"{elastic['minReplicas']}:{elastic['maxReplicas']}"}]
                if "maxRestarts" in elastic:
                    env.append({"name": "PET_MAX_RESTARTS", "value": str(elastic["maxRestarts"])})
                env.append({"name": "PET_NPROC_PER_NODE", "value": nproc})
                if elastic.get("rdzvConf"):
                    env.append({"name": "PET_RDZV_CONF",
                                "value": ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])})
            else:
                env.append({"name": "PET_NNODES", "value": str(total)})
            template = replica["template"]
            container = _container(f"PyTorchJob {name} {role}", template["spec"], "pytorch")
            pod_name = f"{name}-{role}-{index}"
            pods.append(PodTemplate(role, index, pod_name, pod_name, template["spec"], container,
                                    dict(template.get("metadata", {}).get("annotations", {})), env))
    policy = {"pytorchjob": {"master": "Master" in replicas, "elastic": elastic is not None,
                             "backoffLimit": spec.get("runPolicy", {}).get("backoffLimit")}}
    return Workload(overlay, "PyTorchJob", name, pods, policy, ports)


def _trainjob(overlay: str, trainjob: dict, objects: list[dict]) -> Workload:
    name, spec = trainjob["metadata"]["name"], trainjob["spec"]
    reference = spec["runtimeRef"]
    runtimes = [obj for obj in objects if obj.get("kind") == reference.get("kind", "ClusterTrainingRuntime")
                and obj["metadata"]["name"] == reference["name"]]
    if not runtimes:
        raise ManifestError(f"k8s/overlays/{overlay}: TrainJob {name} spec.runtimeRef names {reference['name']!r}, "
                            "which the overlay does not render: add its runtime to the overlay's resources")
    runtime = runtimes[0]["spec"]
    jobs = [job for job in runtime["template"]["spec"]["replicatedJobs"] if job["name"] == "node"]
    if len(jobs) != 1:
        raise ManifestError(f"k8s/overlays/{overlay}: runtime {reference['name']} spec.template.spec.replicatedJobs "
                            "needs exactly one Job named node (the torch plugin's trainer)")
    job_spec = jobs[0]["template"]["spec"]
    num_nodes = spec.get("trainer", {}).get("numNodes", runtime["mlPolicy"].get("numNodes", 1))
    container = _container(f"runtime {reference['name']} node", job_spec["template"]["spec"], "node")
    gpus = container.get("resources", {}).get("limits", {}).get(GPU_RESOURCE)
    nproc = str(spec.get("trainer", {}).get("numProcPerNode") or runtime["mlPolicy"].get("torch", {}).get(
        "numProcPerNode") or ("auto" if gpus else "1"))
    master = f"{name}-node-0-0.{name}"

    def injected(index: int) -> list[dict]:
        return [{"name": "PET_NNODES", "value": str(num_nodes)}, {"name": "PET_NPROC_PER_NODE", "value": nproc},
                {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
                    "fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}},
                {"name": "PET_MASTER_ADDR", "value": master}, {"name": "PET_MASTER_PORT", "value": str(TRAINJOB_PORT)}]

    pods = _job_pods(f"runtime {reference['name']} node", job_spec, f"{name}-node-0", name, num_nodes, "node", injected)
    policy = {"job": {**_job_policy(job_spec), "completions": num_nodes, "parallelism": num_nodes},
              "jobset": runtime["template"]["spec"].get("failurePolicy", {})}
    return Workload(overlay, "TrainJob", name, pods, policy, {f"{master}:{TRAINJOB_PORT}": TRAINJOB_PORT})
