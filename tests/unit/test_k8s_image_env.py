"""Each training pod is told the image it runs (``INSTCLS_IMAGE``, which run.json records): the overlays'
kustomize replacements copy the container's own image field into it, so an image set anywhere, in
k8s/base or in an overlay as `kustomize edit set image` writes it, reaches the variable too."""

import shutil

import pytest
import yaml

from tests.helpers.k8s_manifests import K8S, kubectl_kustomize, load_renderer, pod_templates, training_pods
from trainer.code_identity import IMAGE_VARIABLE

TRAINING_OVERLAYS = ("indexed-job", "indexed-job-elastic", "pytorchjob", "pytorchjob-elastic", "trainjob")
DIGEST = "sha256:" + "0123456789abcdef" * 4


def image_variables(container: dict) -> list[str]:
    return [entry["value"] for entry in container.get("env", []) if entry["name"] == IMAGE_VARIABLE]


def test_every_training_container_is_told_its_own_image():
    for pod in training_pods():
        for container in pod["containers"]:
            assert container["image"] != "instcls", "the image was not set from k8s/base"
            assert image_variables(container) == [container["image"]], container["name"]


def _training_containers(objects: list[dict]) -> list[dict]:
    kinds = {"Job", "PyTorchJob", "ClusterTrainingRuntime"}
    return [container for obj in objects if obj["kind"] in kinds
            for template in pod_templates(obj) for container in template["spec"]["containers"]]


def _renders(directory):
    """The renderer's objects, and kubectl's where it is installed (they must agree)."""
    objects = load_renderer().render(directory)
    if shutil.which("kubectl"):
        assert objects == kubectl_kustomize(directory)
    return objects


@pytest.mark.parametrize("overlay", TRAINING_OVERLAYS)
def test_an_image_set_in_the_overlay_or_the_base_reaches_the_variable(tmp_path, overlay):
    """The overlay's own ``images`` entry (what `kustomize edit set image` adds there) runs after
    k8s/base's, and the replacements after both."""
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("schemas", "grafana", "*.py"))
    kustomization = k8s / "overlays" / overlay / "kustomization.yaml"
    data = yaml.safe_load(kustomization.read_text())
    data["images"] = [{"name": "registry.example.com/instcls", "newName": "mirror.example.com/team/instcls",
                       "digest": DIGEST}]
    kustomization.write_text(yaml.safe_dump(data, sort_keys=False))
    containers = _training_containers(_renders(k8s / "overlays" / overlay))
    assert containers
    for container in containers:
        assert container["image"] == image_variables(container)[0] == f"mirror.example.com/team/instcls@{DIGEST}"

    base = k8s / "base" / "kustomization.yaml"
    data = yaml.safe_load(base.read_text())
    data["images"][0]["newTag"] = "9.9.9"
    base.write_text(yaml.safe_dump(data, sort_keys=False))
    kustomization.write_text(kustomization.read_text().replace("registry.example.com/instcls", "unused/name"))
    for container in _training_containers(_renders(k8s / "overlays" / overlay)):
        assert container["image"] == image_variables(container)[0] == "registry.example.com/instcls:9.9.9"
