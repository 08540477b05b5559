"""The Kubernetes objects the repository deploys, as the tests read them: every overlay under
k8s/overlays rendered (by `kubectl kustomize` where kubectl is installed, else by
k8s/render_overlay.py; tests/unit/test_k8s_render.py checks the two agree) and the files applied
on their own (k8s/*.yaml: volumes, ConfigMaps, monitoring)."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = sorted(path.parent.name for path in (K8S / "overlays").glob("*/kustomization.yaml"))


def dashboard_queries() -> tuple[dict, list[str]]:
    """The Grafana dashboard and every PromQL expression in it (panels' targets, then variables)."""
    dashboard = json.loads((K8S / "grafana/instcls-dashboard.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return dashboard, queries


def load_renderer():
    spec = importlib.util.spec_from_file_location("render_overlay", K8S / "render_overlay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kubectl_kustomize(directory: Path) -> list[dict]:
    """`kubectl kustomize DIRECTORY`, parsed."""
    result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [document for document in yaml.safe_load_all(result.stdout) if document]


@functools.cache
def _rendered(overlay: str) -> tuple[dict, ...]:
    directory = K8S / "overlays" / overlay
    if shutil.which("kubectl"):
        return tuple(kubectl_kustomize(directory))
    return tuple(load_renderer().render(directory))


def rendered(overlay: str) -> list[dict]:
    """The objects ``kubectl apply -k k8s/overlays/OVERLAY`` creates (copies: tests may edit them)."""
    return copy.deepcopy(list(_rendered(overlay)))


def all_documents():
    """(where, object) for everything the deploy steps apply: each overlay, then each plain file."""
    for overlay in OVERLAYS:
        for document in rendered(overlay):
            yield f"overlays/{overlay}", document
    for path in sorted(K8S.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                yield path.name, document


def component(document: dict) -> str | None:
    return document.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component")


def is_training_job(document: dict) -> bool:
    """The training Job (the shard-writing overlay holds Jobs too)."""
    return document["kind"] == "Job" and component(document) == "train"


def pod_templates(document: dict) -> list[dict]:
    """Every pod template in an object (a Job's one, a PyTorchJob's one per replica type): each
    dict with ``spec.containers``, found at any depth."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("spec"), dict) and "containers" in node["spec"]:
                found.append(node)
                return
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(document)
    return found


# The Indexed Job and its elastic form, the PyTorchJob's Master and Worker, the elastic one's Worker,
# the TrainJob's runtime's node.
TRAINING_POD_TEMPLATES = 6
TRAINING_KINDS = ("PyTorchJob", "ClusterTrainingRuntime")  # beside the training Jobs


def training_pods() -> list[dict]:
    """The pod specs of the training Jobs (fixed and elastic), of the PyTorchJobs' replicas (the
    fixed one's Master and Worker, the elastic one's Worker) and of the TrainJob's runtime."""
    pods = [template["spec"] for _, d in all_documents() if is_training_job(d) for template in pod_templates(d)]
    pods += [template["spec"] for _, d in all_documents() if d["kind"] in TRAINING_KINDS
             for template in pod_templates(d)]
    assert len(pods) == TRAINING_POD_TEMPLATES
    return pods
