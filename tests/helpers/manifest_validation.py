"""One rendered Kubernetes object checked offline: a built-in kind against the API's own schema
(kubernetes-validate, strict), a custom resource against its vendored CRD schema with every object
closed, and the pod templates inside a custom resource as the PodTemplates they become."""

from __future__ import annotations

import kubernetes_validate

from tests.helpers.crd_schemas import validate_closed, vendored
from tests.helpers.k8s_manifests import pod_templates

KUBERNETES_VERSION = "1.31.0"
# Each custom resource's real CRD schema, vendored with its source and release (k8s/schemas/README.md)
VENDORED_CRDS = {"TrainJob": "trainer.kubeflow.org_trainjobs.v2.3.0.json",
                 "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.v2.3.0.json",
                 "PyTorchJob": "kubeflow.org_pytorchjobs.v1.9.0.json",
                 "PodMonitor": "monitoring.coreos.com_podmonitors.v0.93.0.json"}


def validate_manifest(document: dict) -> None:
    """Raise ``kubernetes_validate.ValidationError`` or ``jsonschema.ValidationError`` for a field the
    API server would refuse or drop."""
    kind = document["kind"]
    if kind not in VENDORED_CRDS:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        return
    validate_closed(document, vendored(VENDORED_CRDS[kind])["openAPIV3Schema"])
    for template in pod_templates(document):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, KUBERNETES_VERSION, strict=True)
