"""The S3 components, added to each overlay as k8s/README.md says (under its `components:`, after
../../base): k8s/components/s3 gives every training and shard-writing container the endpoint
(ConfigMap instcls-s3, k8s/s3-endpoint.yaml) and the keys (a Secret) through envFrom, neither
optional; k8s/components/s3-web-identity gives the endpoint and runs the pods as the ServiceAccount
that carries the IAM role. Each overlay renders with them through k8s/render_overlay.py and, where
installed, `kubectl kustomize` (the same objects), validates, and changes in nothing else."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from data_pipeline.storage.s3_clients import Boto3Client
from data_pipeline.storage.storage_settings import StorageSettings
from tests.helpers.k8s_manifests import K8S, OVERLAYS, kubectl_kustomize, load_renderer, pod_templates, rendered
from tests.helpers.manifest_validation import validate_manifest

# The containers each overlay's pods run (every one of them reads object storage): the Indexed Job's
# trainer, the PyTorchJob's Master and Worker (the elastic one's Worker only), the TrainJob runtime's
# node, and the make-shards parts and merge.
CONTAINERS = {"indexed-job": 1, "indexed-job-elastic": 1, "pytorchjob": 2, "pytorchjob-elastic": 1, "trainjob": 1,
              "make-shards": 2}
ENDPOINT = yaml.safe_load((K8S / "s3-endpoint.yaml").read_text())
SERVICE_ACCOUNT = yaml.safe_load((K8S / "components/s3-web-identity/service-account.yaml").read_text())
SECRET = "instcls-s3-credentials"
ENDPOINT_SOURCE = {"configMapRef": {"name": ENDPOINT["metadata"]["name"], "optional": False}}
SECRET_SOURCE = {"secretRef": {"name": SECRET, "optional": False}}


def render_with(tmp_path, overlay: str, component: str) -> list[dict]:
    """``overlay`` with ``k8s/components/COMPONENT`` listed after ../../base in its own components, in a
    copy of k8s/; the renderer's objects, checked against kubectl's where it is installed."""
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("schemas", "grafana", "*.py"))
    kustomization = k8s / "overlays" / overlay / "kustomization.yaml"
    data = yaml.safe_load(kustomization.read_text())
    data["components"].append(f"../../components/{component}")
    kustomization.write_text(yaml.safe_dump(data, sort_keys=False))
    objects = load_renderer().render(k8s / "overlays" / overlay)
    if shutil.which("kubectl"):
        assert objects == kubectl_kustomize(k8s / "overlays" / overlay), overlay  # same objects, same order
    return objects


def pods(objects: list[dict]) -> list[dict]:
    return [template["spec"] for document in objects for template in pod_templates(document)]


def without(objects: list[dict], sources: list[dict], service_account: bool) -> list[dict]:
    """``objects`` with the component's envFrom entries (and ServiceAccount) taken out again."""
    for pod in pods(objects):
        if service_account:
            assert pod.pop("serviceAccountName") == SERVICE_ACCOUNT["metadata"]["name"]
        for container in pod["containers"]:
            kept = [source for source in container["envFrom"] if source not in sources]
            if kept:
                container["envFrom"] = kept
            else:
                del container["envFrom"]
    return objects


def test_every_overlay_is_covered():
    """A new overlay must be added above, with its count of containers, before it can ship."""
    assert set(CONTAINERS) == set(OVERLAYS)


@pytest.mark.parametrize("overlay", sorted(CONTAINERS))
def test_the_s3_component_gives_every_container_the_endpoint_and_the_keys(tmp_path, overlay):
    objects = render_with(tmp_path, overlay, "s3")
    containers = [container for pod in pods(objects) for container in pod["containers"]]
    assert len(containers) == CONTAINERS[overlay]
    for container in containers:
        # after NCCL's fabric where the container has it; a missing Secret or ConfigMap stops the pod
        assert container["envFrom"][-2:] == [ENDPOINT_SOURCE, SECRET_SOURCE], container["name"]
        # an inline variable would win over the ConfigMap's
        assert not {entry["name"] for entry in container.get("env", [])} & {*ENDPOINT["data"], "AWS_ACCESS_KEY_ID"}
    for document in objects:
        validate_manifest(document)
    assert without(objects, [ENDPOINT_SOURCE, SECRET_SOURCE], service_account=False) == rendered(overlay)


@pytest.mark.parametrize("overlay", sorted(CONTAINERS))
def test_the_web_identity_component_runs_the_pods_as_the_role_instead(tmp_path, overlay):
    objects = render_with(tmp_path, overlay, "s3-web-identity")
    assert sum(len(pod["containers"]) for pod in pods(objects)) == CONTAINERS[overlay]
    for pod in pods(objects):
        assert pod["serviceAccountName"] == SERVICE_ACCOUNT["metadata"]["name"]
        for container in pod["containers"]:
            # no keys: static keys in the environment would win over the role's credentials
            assert container["envFrom"][-1] == ENDPOINT_SOURCE and SECRET not in str(container), container["name"]
    for document in objects:
        validate_manifest(document)
    assert without(objects, [ENDPOINT_SOURCE], service_account=True) == rendered(overlay)


def test_the_readme_shows_the_patch_the_web_identity_component_applies():
    """k8s/README.md shows the Indexed Job's patch as the component writes it (its name test aside)."""
    readme = (K8S / "README.md").read_text()
    (shown,) = re.findall(r"components/s3-web-identity` in the overlay instead.*?```yaml\n(.*?)```", readme, re.S)
    component = yaml.safe_load((K8S / "components/s3-web-identity/kustomization.yaml").read_text())
    (patch,) = [p["patch"] for p in component["patches"] if p["target"] == {"kind": "Job", "name": "instcls-train"}]
    assert yaml.safe_load(shown) == [op for op in yaml.safe_load(patch) if op["op"] != "test"]


def test_the_service_account_names_an_iam_role():
    validate_manifest(SERVICE_ACCOUNT)
    role = SERVICE_ACCOUNT["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
    assert re.fullmatch(r"arn:aws:iam::\d{12}:role/[\w+=,.@/-]+", role)


def test_the_pods_s3_client_reaches_the_configmaps_endpoint_with_the_secrets_keys(monkeypatch):
    """The variable names, read by the client instcls builds: the ConfigMap's endpoint and region, and the
    keys k8s/README.md tells you to put in the Secret (what its `kubectl create secret` command names)."""
    validate_manifest(ENDPOINT)
    assert set(ENDPOINT["data"]) == {"AWS_ENDPOINT_URL_S3", "AWS_REGION"}
    readme = (K8S / "README.md").read_text()
    (command,) = re.findall(rf"kubectl create secret generic {SECRET}((?:\s+\\?\s*--from-literal=\w+=\S*)+)", readme)
    keys = re.findall(r"--from-literal=(\w+)=", command)
    assert sorted(keys) == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    for name in ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ROLE_ARN",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    for name, value in {**ENDPOINT["data"], **{key: f"value-of-{key}" for key in keys}}.items():
        monkeypatch.setenv(name, value)
    client = Boto3Client(StorageSettings())._s3
    assert client.meta.endpoint_url == ENDPOINT["data"]["AWS_ENDPOINT_URL_S3"]
    assert client.meta.region_name == ENDPOINT["data"]["AWS_REGION"]
    credentials = client._request_signer._credentials
    assert (credentials.access_key, credentials.secret_key) == ("value-of-AWS_ACCESS_KEY_ID",
                                                                "value-of-AWS_SECRET_ACCESS_KEY")
    assert client.meta.config.s3["addressing_style"] == "path"  # a custom endpoint: path-style


def test_a_patch_that_would_wire_another_container_fails_to_render(tmp_path):
    """The components test each container's name before they edit it: a sidecar placed first in the
    Indexed Job stops the render instead of giving the sidecar the keys."""
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("schemas", "grafana", "*.py"))
    workload = k8s / "overlays/indexed-job/indexed-job.yaml"
    workload.write_text(workload.read_text().replace("      containers:\n", "      containers:\n"
                                                     "      - {name: sidecar, image: instcls}\n", 1))
    kustomization = k8s / "overlays/indexed-job/kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace("- ../../base\n",
                                                               "- ../../base\n- ../../components/s3\n"))
    renderer = load_renderer()
    with pytest.raises(renderer.UnsupportedKustomization,
                       match=r"patch test failed: /spec/template/spec/containers/0/name is 'sidecar', not 'trainer'"):
        renderer.render(k8s / "overlays/indexed-job")
    if shutil.which("kubectl"):
        with pytest.raises(AssertionError, match="kubectl kustomize .* failed"):
            kubectl_kustomize(k8s / "overlays/indexed-job")
