"""k8s/make-shards-job.yaml validates offline, and what its pods run is what instcls accepts: every
completion a different --part of the same ingest, the merge waiting on that ingest's --out."""

from pathlib import Path

import kubernetes_validate
import yaml

from trainer.cli import build_parser
from data_pipeline.ingest_state import Part

JOB_FILE = Path(__file__).resolve().parents[2] / "k8s" / "make-shards-job.yaml"


def _jobs():
    parts, merge = list(yaml.safe_load_all(JOB_FILE.read_text()))
    return parts, merge


def _command(job, index=None):
    container = job["spec"]["template"]["spec"]["containers"][0]
    args = [arg.split("  #")[0] for arg in container["args"]]
    if index is not None:
        args = [arg.replace("$(JOB_COMPLETION_INDEX)", str(index)) for arg in args]
    return container, build_parser().parse_args(container["command"][1:] + args)


def test_the_jobs_validate_and_run_commands_instcls_accepts():
    parts, merge = _jobs()
    for job in (parts, merge):
        kubernetes_validate.validate(job, "1.31.0", strict=True)
    spec = parts["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] <= spec["completions"]
    outs, seen = set(), []
    for index in range(spec["completions"]):
        container, args = _command(parts, index)
        seen.append(Part.parse(args.part))
        outs.add(str(args.out))
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts[str(args.root)].get("readOnly") and not mounts[str(args.out.parent)].get("readOnly")
        assert args.workers == int(container["resources"]["requests"]["cpu"])
    assert seen == [Part(index, spec["completions"]) for index in range(spec["completions"])]
    index_env = next(e for e in container["env"] if e["name"] == "JOB_COMPLETION_INDEX")
    assert "job-completion-index" in index_env["valueFrom"]["fieldRef"]["fieldPath"]
    _, merged = _command(merge)
    assert merged.handler.__name__ == "_run_merge_shards" and outs == {str(merged.out)} and merged.wait > 0
    failing = spec["podFailurePolicy"]["rules"][1]
    assert failing["action"] == "FailIndex" and failing["onExitCodes"]["values"] == [2]
