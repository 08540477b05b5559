"""The TrainJob overlay against Kubeflow Trainer's real CRD schemas (v2.3.0, vendored with their
source), every object closed: a misspelled field is refused at each level (the TrainJob, its
runtime, the JobSet template the runtime embeds, the pod spec), and the runtime carries what the
Indexed Job carries (image, volumes, NCCL's fabric, grace period, queue label, exit-code rules)."""

from __future__ import annotations

import jsonschema
import pytest

from tests.helpers.crd_schemas import validate_closed, vendored
from tests.helpers.k8s_manifests import rendered
from trainer.exit_codes import PERMANENT, ExitCode

TRAINJOB = "trainer.kubeflow.org_trainjobs.v2.3.0.json"
RUNTIME = "trainer.kubeflow.org_clustertrainingruntimes.v2.3.0.json"


def _objects():
    by_kind = {d["kind"]: d for d in rendered("trainjob")}
    return by_kind["TrainJob"], by_kind["ClusterTrainingRuntime"]


def _node_job(runtime: dict) -> dict:
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return node["template"]["spec"]


def test_the_trainjob_overlay_validates_against_the_vendored_schemas():
    trainjob, runtime = _objects()
    validate_closed(trainjob, vendored(TRAINJOB)["openAPIV3Schema"])
    validate_closed(runtime, vendored(RUNTIME)["openAPIV3Schema"])
    assert trainjob["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                              "name": runtime["metadata"]["name"]}
    assert vendored(TRAINJOB)["release"] == vendored(RUNTIME)["release"] == "kubeflow/trainer v2.3.0"


@pytest.mark.parametrize("level, plant", [
    ("TrainJob", lambda trainjob, runtime: trainjob["spec"]["trainer"].update(numNode=8)),
    ("runtime", lambda trainjob, runtime: runtime["spec"]["mlPolicy"].update(numNode=8)),
    ("JobSet template", lambda trainjob, runtime: runtime["spec"]["template"]["spec"]["failurePolicy"].update(
        maxRestart=3)),
    ("pod spec", lambda trainjob, runtime: _node_job(runtime)["template"]["spec"].update(
        terminationGracePeriod=600)),
])
def test_a_misspelled_field_is_refused_at_every_level(level, plant):
    trainjob, runtime = _objects()
    plant(trainjob, runtime)
    document, schema = (trainjob, TRAINJOB) if level == "TrainJob" else (runtime, RUNTIME)
    with pytest.raises(jsonschema.ValidationError, match="Additional properties are not allowed"):
        validate_closed(document, vendored(schema)["openAPIV3Schema"])


def test_the_runtime_carries_what_the_indexed_job_carries():
    trainjob, runtime = _objects()
    (indexed,) = [d for d in rendered("indexed-job") if d["kind"] == "Job"]
    job = _node_job(runtime)
    pod, indexed_pod = job["template"]["spec"], indexed["spec"]["template"]["spec"]
    container, indexed_container = pod["containers"][0], indexed_pod["containers"][0]
    assert container["name"] == "node"  # the container the torch plugin gives PET_* to
    assert container["image"] == indexed_container["image"] and container["command"] == ["instcls", "launch"]
    assert pod["volumes"] == indexed_pod["volumes"] and container["volumeMounts"] == indexed_container["volumeMounts"]
    assert container["envFrom"] == indexed_container["envFrom"] == [{"configMapRef": {"name": "instcls-nccl"}}]
    assert container["resources"] == indexed_container["resources"]
    assert pod["terminationGracePeriodSeconds"] == indexed_pod["terminationGracePeriodSeconds"]
    assert "--set=logging.trainjob_status=true" in container["args"]
    assert trainjob["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == \
        indexed["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    rules = job["podFailurePolicy"]["rules"]
    by_code = [(r["action"], code) for r in rules if "onExitCodes" in r for code in r["onExitCodes"]["values"]]
    ignored = {code for action, code in by_code if action == "Ignore"}
    failing = {code for action, code in by_code if action == "FailJob"}
    assert ignored == {ExitCode.PREEMPTED} and failing == set(PERMANENT)
    assert all(r["onExitCodes"]["containerName"] == "node" for r in rules if "onExitCodes" in r)
    assert {"action": "Ignore", "onPodConditions": [{"status": "True", "type": "DisruptionTarget"}]} in rules
    jobset_rules = runtime["spec"]["template"]["spec"]["failurePolicy"]["rules"]
    assert {"name": "hopeless", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]} in jobset_rules
