"""`make image-check`: build the image, then run it the way the Kubernetes pod does (the training
manifest's command, environment, working directory, user and mounts; ``pod_spec.py``) and check
what it holds:

* ``instcls --version``, which must name the commit the image was built from and the image;
  what the image holds: every ``==`` pin of pyproject.toml, ``pip check``,
  no build context it should not carry (``.dockerignore``), the non-root user (uid 1000);
* ``instcls selftest`` (its CPU rows without a GPU);
* ``instcls plan`` on the shipped ImageNet-21K config;
* shards made inside the image, then the manifest's training command on 2 CPU ranks for one epoch
  with a checkpoint, then again for a second epoch, which must resume from it;
* ``instcls eval knn`` on the checkpoint;
* the read-only root: under Docker ``--read-only`` enforces it; under buildah every file of the
  container's root is compared before and after, and any write outside the pod's volumes fails.

Prints each step's result and the image's size; exits 1 on any failure.  Logs: out/image-check/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from scripts.image.build import ROOT, build_image, commit_build_args, default_tag
from scripts.image.engines import Buildah, Docker, ImageToolError, RunSpec, docker_answers
from scripts.image.pod_spec import PodSpec, read_pod_spec
from trainer.code_identity import GIT_COMMIT_VARIABLE, IMAGE_VARIABLE
from trainer.parallel.launch import free_port

WORK = ROOT / "out" / "image-check"
JOB_TEMPLATE = ROOT / "configs" / "digits_cpu.yaml"
DEEPSPEED_CONFIG = ROOT / "ds_configs" / "zero0.json"
PLANNED_CONFIG = "configs/in21k_r50_64gpu.yaml"  # relative to the image's working directory
PLANNED_RANKS = "64"  # the config's 8 nodes of 8 GPUs
PLANNED_CLASSES = "14197122"  # ImageNet-21K's images (the image has no shards to count)
PIN = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^;\s]+)")
CONFIG_DIR, SHARDS_DIR, CHECKPOINTS_DIR = "/etc/instcls", "/data/shards", "/checkpoints"
# Nothing of the build context but the package, its configs and pyproject belongs in the image.
CONTEXT_LEFTOVERS = (".git", ".venv", ".ci", "out", "tests", "k8s", ".pytest_cache", ".ruff_cache", "build")
# The pod runs 8 ranks of 8 threads on a GPU node; here, 2 ranks on 2 cores.
LOCAL_ENV = {"PET_NNODES": "1", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "2", "PET_MASTER_ADDR": "127.0.0.1",
             "OMP_NUM_THREADS": "1"}
# What buildah's chroot run cannot show, named in the report.
NOT_CHECKED_UNDER_BUILDAH = ("seccomp (RuntimeDefault)", "allowPrivilegeEscalation", "a memory limit",
                             "a network namespace of its own")

IMAGE_CONTENTS_PROGRAM = r"""
import json, os, subprocess, sys
from importlib.metadata import PackageNotFoundError, version
pins, leftovers = json.loads(sys.argv[1]), json.loads(sys.argv[2])
problems = []
for name, pinned in pins.items():
    try:
        found = version(name)
    except PackageNotFoundError:
        found = None
    if found != pinned:
        problems.append(f"{name}=={pinned} is pinned, the image has {found}")
check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
if check.returncode:
    problems.append("pip check: " + check.stdout.strip())
present = [name for name in leftovers if os.path.exists(name)]
present += [os.path.join(d, n) for d, names, _ in os.walk(".") for n in names if n == "__pycache__"]
present += [n for n in os.listdir(".") if n.endswith(".egg-info")]
if present:
    problems.append("left over from the build context or the build: " + ", ".join(sorted(present)))
if os.getuid() != 1000:
    problems.append(f"the image's user runs as uid {os.getuid()}, not 1000")
print(json.dumps({"pins": len(pins), "problems": problems}))
sys.exit(1 if problems else 0)
"""


@dataclass
class StepResult:
    name: str
    ok: bool
    seconds: float
    detail: str


def pinned_versions(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """``name -> version`` of every ``name==version`` among the project's dependencies (the image
    installs no extras)."""
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", pyproject.read_text(), re.MULTILINE | re.DOTALL)
    if block is None:
        raise ImageToolError(f"{pyproject} has no dependencies = [...] list")
    dependencies = re.findall(r'"([^"]+)"', block.group(1))
    return dict(match.groups() for match in map(PIN.match, dependencies) if match)


class PodRunner:
    """Runs commands in one container of the image as the pod would: its user, working directory,
    environment (plus ``LOCAL_ENV``, and ``INSTCLS_IMAGE`` = ``tag``, which the overlays' replacements set
    in the cluster) and volumes, each volume a host directory under ``work``."""

    def __init__(self, engine: Docker | Buildah, tag: str, pod: PodSpec, work: Path) -> None:
        self.engine, self.pod, self.tag = engine, pod, tag
        self.volumes: dict[str, tuple[str, bool]] = {}
        for mount in pod.mounts:
            host = work / "volumes" / mount.path.strip("/").replace("/", "_")
            host.mkdir(parents=True, exist_ok=True)
            os.chmod(host, 0o1777)  # like an emptyDir; the checkpoint volume's fsGroup makes it the user's
            self.volumes[str(host)] = (mount.path, mount.read_only)
        self.handle = engine.start(tag)

    def host_dir(self, container_path: str) -> Path:
        for host, (path, _) in self.volumes.items():
            if path == container_path:
                return Path(host)
        raise KeyError(f"the pod mounts nothing at {container_path}")

    def run(self, argv: list[str], log: Path, writable: tuple[str, ...] = (), env: dict[str, str] | None = None):
        """``argv`` in the container, output to ``log``; ``writable`` lists read-only mounts this
        command may write (the shards, which a separate job writes in the cluster)."""
        volumes = {host: (path, read_only and path not in writable) for host, (path, read_only) in self.volumes.items()}
        spec = RunSpec(argv=tuple(argv), user=f"{self.pod.user}:{self.pod.group}", working_dir=self.pod.working_dir,
                       env={**self.pod.env, IMAGE_VARIABLE: self.tag, **LOCAL_ENV, **(env or {})}, volumes=volumes,
                       read_only_root=self.pod.read_only_root)
        result = self.engine.run(self.handle, spec, capture=True)
        log.write_text(f"$ {' '.join(argv)}\n{result.stdout}\n{result.stderr}")
        return result

    def close(self) -> None:
        self.engine.stop(self.handle)


def write_job_config(config_dir: Path, epochs: int) -> None:
    """The ConfigMap's two files: the tests' digits job at the pod's paths, ``epochs`` long, with a
    checkpoint every epoch; the CPU DeepSpeed config."""
    job = yaml.safe_load(JOB_TEMPLATE.read_text())
    job["data"]["train_shards"] = f"{SHARDS_DIR}/train"
    job["data"]["eval_shards"] = f"{SHARDS_DIR}/val"
    job["optim"]["epochs"] = epochs
    job["checkpoint"] = {"dir": f"{CHECKPOINTS_DIR}/digits", "every_epochs": 1}
    job["logging"]["dir"] = f"{CHECKPOINTS_DIR}/digits-logs"
    (config_dir / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    shutil.copyfile(DEEPSPEED_CONFIG, config_dir / "deepspeed.json")


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def version_pattern(tag: str, commit: str | None) -> str:
    """What ``instcls --version`` prints in the pod: the version, the commit the build was given (any
    line when none was), the image."""
    code = f"git {commit}[^\n]*" if commit else "[^\n]*"
    return f"instcls \\S+\n{code}\nimage {re.escape(tag)}"


def run_steps(runner: PodRunner, logs: Path, commit: str | None = None) -> list[StepResult]:
    """The checks in order; ``commit``: the one the build was given, which ``instcls --version`` must name."""
    results: list[StepResult] = []

    def step(name: str, argv: list[str], expect: str | None = None, summary=None, **kwargs) -> None:
        """Run ``argv``; it passes when it exits 0 and its output matches ``expect``, which is then
        its detail (or ``summary(output)``'s)."""
        started = time.monotonic()
        log = logs / f"{len(results) + 1:02d}-{name.split()[0]}.log"
        result = runner.run(argv, log, **kwargs)
        output = result.stdout + result.stderr
        found = re.search(expect, output) if expect else None
        ok = result.returncode == 0 and (expect is None or found is not None)
        detail = f"exit {result.returncode}" + ("" if ok or result.returncode else f", no /{expect}/ in the output")
        if ok and found:
            detail = summary(output) if summary else found.group(0)
        if not ok:
            detail += f" ({log}):\n{tail(output)}"
        announce(StepResult(name, ok, time.monotonic() - started, detail))

    def announce(result: StepResult) -> None:
        results.append(result)
        print(f"[{'ok' if result.ok else 'FAILED'}] {result.name} ({result.seconds:.0f} s): {result.detail}",
              flush=True)

    config_dir = runner.host_dir(CONFIG_DIR)
    write_job_config(config_dir, epochs=1)
    port = {"PET_MASTER_PORT": str(free_port())}
    step("instcls --version", ["instcls", "--version"], expect=version_pattern(runner.tag, commit))
    step("image contents", ["python", "-c", IMAGE_CONTENTS_PROGRAM, json.dumps(pinned_versions()),
                            json.dumps(CONTEXT_LEFTOVERS)], expect=r'"pins": \d+', summary=contents_summary)
    before = runner.engine.root_files(runner.handle)  # after a first run made the mount points
    step("instcls selftest", ["instcls", "selftest"], expect=r"(?m)^devices +pass", summary=selftest_summary)
    step("instcls plan (ImageNet-21K)", ["instcls", "plan", "--config", PLANNED_CONFIG, "--ranks", PLANNED_RANKS,
                                         "--num-classes", PLANNED_CLASSES],
         expect=r"recommended: ZeRO-\d", summary=plan_summary)
    for split in ("train", "val"):
        step(f"make-shards {split}", ["instcls", "make-shards", "--source", "digits", "--split", split, "--out",
                                      f"{SHARDS_DIR}/{split}", "--no-progress"], expect=r"wrote \d+ instances.*",
             writable=(SHARDS_DIR,))
    step("train 1 epoch (the pod's command)", list(runner.pod.command), expect=r"saved \S+", env=port)
    write_job_config(config_dir, epochs=2)
    step("resume for epoch 2 (the pod's command)", list(runner.pod.command), expect=r"resumed from \S+ at epoch 1",
         env=port)
    step("instcls eval knn", ["instcls", "eval", "knn", "--config", f"{CONFIG_DIR}/job.yaml", "--checkpoint", "auto"],
         expect=r"kNN[^\n]*\d+\.\d+%")
    if not runner.pod.read_only_root:
        announce(StepResult("read-only root file system", True, 0.0, "not asked for by the manifest"))
    elif before is None:  # the engine mounted the root read-only for every step
        announce(StepResult("read-only root file system", True, 0.0,
                            f"every step ran on a read-only root ({runner.engine.name} run --read-only)"))
    else:
        announce(read_only_root(before, runner.engine.root_files(runner.handle)))
    return results


def contents_summary(output: str) -> str:
    pins = json.loads(re.search(r'(?m)^\{"pins".*$', output).group(0))["pins"]
    return f"{pins} pins hold, pip check passes, nothing left over from the build, uid 1000"


def plan_summary(output: str) -> str:
    """The plan's per-rank total and the stage it recommends."""
    total = re.search(r"(?m)^\w+: N=.*$", output)
    stage = re.search(r"recommended: ZeRO-\d", output)
    return f"{total.group(0) if total else ''}; {stage.group(0)}"


def selftest_summary(output: str) -> str:
    """"6 pass, 1 skipped (...)" from ``instcls selftest``'s table (exit 1 on any failure)."""
    table = output[output.index("\ncheck "):]
    rows = re.findall(r"(?m)^(\S.*?)  +(pass|FAIL|skipped)\b", table)
    skipped = [name.strip() for name, status in rows if status == "skipped"]
    passed = sum(status == "pass" for _, status in rows)
    return f"{passed} pass, {len(skipped)} skipped" + (f" ({', '.join(skipped)})" if skipped else "")


def read_only_root(before: dict, after: dict) -> StepResult:
    """What a read-only root would have refused: files made, changed or removed outside the volumes.
    Bytecode Python fails to cache is not an error under a read-only root, only slower starts."""
    changed = sorted(path for path in set(before) | set(after) if before.get(path) != after.get(path))
    writes = [path for path in changed if "/__pycache__" not in path]
    bytecode = len(changed) - len(writes)
    detail = (f"{len(writes)} writes outside the volumes" + (f": {', '.join(writes[:10])}" if writes else "")
              + (f"; {bytecode} bytecode files Python would skip caching" if bytecode else ""))
    return StepResult("read-only root file system", not writes, 0.0, detail)


def report(results: list[StepResult], engine, tag: str) -> bool:
    print(f"\nimage {tag} ({engine.name}): {engine.size(tag)}")
    for result in results:
        first_line = result.detail.splitlines()[0] if result.detail else ""
        print(f"  {'ok    ' if result.ok else 'FAILED'} {result.seconds:6.0f} s  {result.name}: {first_line}")
    if not engine.enforces_read_only_root:
        print(f"  not checked under buildah (no container runtime runs here): {', '.join(NOT_CHECKED_UNDER_BUILDAH)}")
    return all(result.ok for result in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default=None, help="image name (default localhost/instcls:<package version>)")
    parser.add_argument("--no-build", action="store_true", help="check the image --tag names as it is")
    args = parser.parse_args(argv)
    tag = args.tag or default_tag()
    started = time.monotonic()
    try:
        engine = (Docker() if docker_answers() else Buildah()) if args.no_build else build_image(tag)
        pod = read_pod_spec()
        shutil.rmtree(WORK, ignore_errors=True)
        (WORK / "logs").mkdir(parents=True)
        runner = PodRunner(engine, tag, pod, WORK)
        try:
            results = run_steps(runner, WORK / "logs", None if args.no_build else commit_build_args().get(
                GIT_COMMIT_VARIABLE))
        finally:
            runner.close()
        ok = report(results, engine, tag)
    except ImageToolError as error:
        print(f"make image-check: {error}", file=sys.stderr)
        return 1
    print(f"make image-check: {'passed' if ok else 'FAILED'} in {time.monotonic() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
