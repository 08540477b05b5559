"""The shard-writing overlay (k8s/overlays/make-shards): an Indexed Job whose completions write the
parts of one ingest and a Job that merges them, as `kubectl apply -k` would create them."""

import re

from data_pipeline.ingest.ingest_state import Part
from tests.helpers.k8s_manifests import component, pod_templates, rendered
from trainer.cli import build_parser
from trainer.exit_codes import ExitCode

INDEX = "$(JOB_COMPLETION_INDEX)"


def jobs():
    objects = {component(d): d for d in rendered("make-shards")}
    assert [d["kind"] for d in objects.values()] == ["Job", "Job"]
    return objects["make-shards"], objects["make-shards-merge"]


def container_of(job):
    (template,) = pod_templates(job)
    (container,) = template["spec"]["containers"]
    return template["spec"], container


def flag(args, name):
    (value,) = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"--{name}=")]
    return value


def test_every_completion_writes_its_part_of_one_ingest_and_the_merge_waits_for_them():
    parts, merge = jobs()
    spec = parts["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
    pod, container = container_of(parts)
    args = container["args"]
    assert container["command"] == ["instcls", "make-shards"]
    assert flag(args, "part") == f"{INDEX}/{spec['completions']}"  # completion I writes part I of K = completions
    index_env = next(e for e in container["env"] if e["name"] == "JOB_COMPLETION_INDEX")
    assert index_env["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert int(flag(args, "workers")) == int(container["resources"]["requests"]["cpu"])  # the container sees every core
    # The source is read-only; the output is written to the shard volume the training pods read.
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    root, out = flag(args, "root"), flag(args, "out")
    (source,) = [m for path, m in mounts.items() if root.startswith(path)]
    (target,) = [m for path, m in mounts.items() if out.startswith(path + "/")]
    assert source.get("readOnly") and not target.get("readOnly")
    assert volumes[target["name"]]["persistentVolumeClaim"]["claimName"] == "instcls-shards"
    # The merge reads the same output directory and waits for the parts it started beside.
    merge_pod, merge_container = container_of(merge)
    assert merge_container["command"] == ["instcls", "merge-shards"]
    assert merge_container["args"][0] == out and float(flag(merge_container["args"], "wait")) > 3600
    merge_mounts = {m["mountPath"]: m for m in merge_container["volumeMounts"]}
    assert not merge_mounts[target["mountPath"]].get("readOnly")
    assert {v["name"]: v for v in merge_pod["volumes"]}[target["name"]] == volumes[target["name"]]
    for job_container in (container, merge_container):
        assert job_container["securityContext"]["readOnlyRootFilesystem"]
        writable = {m["mountPath"] for m in job_container["volumeMounts"] if not m.get("readOnly")}
        assert writable == {"/tmp", target["mountPath"]}


def test_a_preempted_part_resumes_and_bad_input_stops_without_retries():
    parts, merge = jobs()
    for job, action in ((parts, "FailIndex"), (merge, "FailJob")):
        rules = job["spec"]["podFailurePolicy"]["rules"]
        assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
        _, container = container_of(job)
        assert rules[1] == {"action": action, "onExitCodes": {"containerName": container["name"], "operator": "In",
                                                              "values": [int(ExitCode.BAD_INPUT)]}}
        assert job["spec"]["podReplacementPolicy"] == "Failed"  # never two writers of one part at once
    assert 1 <= parts["spec"]["backoffLimitPerIndex"] <= 5  # other failures: a few retries, each resuming its part


def test_the_shard_writing_pods_run_commands_instcls_accepts():
    parser = build_parser()
    parts, merge = jobs()
    _, container = container_of(parts)
    seen = []
    for index in range(parts["spec"]["completions"]):
        args = [arg.replace(INDEX, str(index)) for arg in container["args"]]
        parsed = parser.parse_args(container["command"][1:] + args)
        seen.append(Part.parse(parsed.part))
        assert re.fullmatch(r"[\w./-]+", str(parsed.out))
    assert seen == [Part(index, len(seen)) for index in range(len(seen))]
    _, merge_container = container_of(merge)
    merged = parser.parse_args(merge_container["command"][1:] + merge_container["args"])
    assert merged.handler.__name__ == "_run_merge_shards" and str(merged.out) == str(parsed.out) and merged.wait > 0
