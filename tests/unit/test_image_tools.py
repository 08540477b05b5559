"""What `make image` and `make image-check` read from the repository: the pod's spec from the
training manifest, the Dockerfile's base, the pins the image must hold, and the read-only-root
comparison.  Building and running the image is `tests/integration/test_image_check.py` (slow)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from scripts.image.base_image import debian_suite, dockerfile_base
from scripts.image.check import CHECKPOINTS_DIR, CONFIG_DIR, SHARDS_DIR, pinned_versions, read_only_root
from scripts.image.engines import RunSpec
from scripts.image.pod_spec import MANIFEST, read_pod_spec

ROOT = Path(__file__).resolve().parents[2]


def test_the_pod_spec_is_the_manifests_master_container():
    """Independent reading: the manifest's YAML walked by hand."""
    pod = read_pod_spec()
    container = yaml.safe_load(MANIFEST.read_text())["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]
    assert pod.command == tuple(container["command"] + container["args"])
    assert pod.command[:2] == ("instcls", "launch")
    assert pod.env == {e["name"]: e["value"] for e in container["env"]}
    assert (pod.user, pod.group) == (1000, 1000)
    assert pod.read_only_root
    assert pod.mount(SHARDS_DIR).read_only and pod.mount(CONFIG_DIR).read_only
    assert not pod.mount(CHECKPOINTS_DIR).read_only and not pod.mount("/tmp").read_only
    assert not pod.mount("/dev/shm").read_only


def test_a_manifest_without_a_user_is_refused(tmp_path):
    job = yaml.safe_load(MANIFEST.read_text())
    spec = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    del spec["securityContext"]["runAsUser"]
    spec["containers"][0]["securityContext"].pop("runAsUser", None)
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job))
    with pytest.raises(ValueError, match="sets no runAsUser"):
        read_pod_spec(manifest)


@pytest.mark.parametrize("line,name", [
    ("FROM python:3.11-slim-bookworm", "docker.io/library/python:3.11-slim-bookworm"),
    ("from --platform=linux/amd64 someone/python:3.11-slim-bookworm AS base",
     "docker.io/someone/python:3.11-slim-bookworm"),
    ("FROM registry.example.com/python:3.11-slim-bookworm", "registry.example.com/python:3.11-slim-bookworm"),
])
def test_the_base_is_named_as_docker_qualifies_it(tmp_path, line, name):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"# a comment\n{line}\nRUN true\n")
    assert dockerfile_base(dockerfile) == name


def test_the_repository_dockerfile_builds_on_a_base_mmdebstrap_can_make():
    base = dockerfile_base(ROOT / "Dockerfile")
    assert debian_suite(base) == "bookworm"
    with pytest.raises(ValueError, match="only python:\\*-slim-<debian release>"):
        debian_suite("docker.io/library/python:3.11-alpine")


def test_the_pins_are_pyprojects_exact_dependencies():
    """Independent reading through tomllib: every `==` of [project] dependencies, no extras."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    expected = {d.split("==")[0].strip(): d.split("==")[1].split(";")[0].strip() for d in dependencies if "==" in d}
    assert pinned_versions() == expected
    assert "torch" in expected and "pytest" not in pinned_versions()


def test_a_write_outside_the_volumes_fails_the_read_only_root():
    before = {"/etc": (0, 0), "/etc/passwd": (5, 100), "/usr/lib/x/__pycache__": (0, 0)}
    unchanged = read_only_root(before, dict(before))
    assert unchanged.ok and unchanged.detail.startswith("0 writes")
    after = dict(before, **{"/etc/passwd": (6, 120), "/opt/new": (7, 1), "/usr/lib/x/__pycache__/m.pyc": (8, 9)})
    changed = read_only_root(before, after)
    assert not changed.ok
    assert "2 writes outside the volumes: /etc/passwd, /opt/new" in changed.detail
    assert "1 bytecode files" in changed.detail


def test_a_run_spec_gives_docker_and_buildah_the_pods_directory_environment_and_volumes():
    spec = RunSpec(argv=("instcls", "--version"), user="1000:1000", working_dir="/opt/instcls",
                   env={"HOME": "/tmp/home"},
                   volumes={"/host/tmp": ("/tmp", False), "/host/cfg": ("/etc/instcls", True)})
    assert spec.options("--workingdir") == ["--workingdir", "/opt/instcls", "--env", "HOME=/tmp/home",
                                            "--volume", "/host/tmp:/tmp", "--volume", "/host/cfg:/etc/instcls:ro"]
    assert RunSpec(argv=("true",), user="0", working_dir=None).options("--workdir") == []


def test_make_image_tells_the_build_the_checkouts_commit(tmp_path, monkeypatch):
    """`git` itself is the reference; a folder that is no checkout gives the build nothing."""
    import subprocess

    from scripts.image import engines
    from scripts.image.build import commit_build_args

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD"]).returncode != 0
    args = commit_build_args(ROOT)
    assert args == {"INSTCLS_GIT_COMMIT": head, "INSTCLS_GIT_DIRTY": "true" if changed else "false"}
    assert commit_build_args(tmp_path) == {}
    commands = []
    monkeypatch.setattr(engines, "run_command", lambda argv, **kwargs: commands.append(argv))
    engines.Docker().build("t:1", tmp_path, args)
    engines.Buildah().build("t:1", tmp_path, args)
    for argv in commands:
        flags = [argv[i + 1] for i, word in enumerate(argv) if word == "--build-arg"]
        assert flags == [f"INSTCLS_GIT_COMMIT={head}", f"INSTCLS_GIT_DIRTY={args['INSTCLS_GIT_DIRTY']}"]
        assert argv[-1] == str(tmp_path)


def test_the_image_check_gives_the_pod_its_image_and_expects_version_to_name_it(tmp_path):
    import re

    from scripts.image.check import PodRunner, version_pattern

    class Recorder:
        def start(self, tag):
            return "container"

        def run(self, handle, spec, capture=False):
            self.spec = spec
            return SimpleNamespace(stdout="", stderr="", returncode=0)

    engine = Recorder()
    runner = PodRunner(engine, "localhost/instcls:9.9.9", read_pod_spec(), tmp_path)
    runner.run(["instcls", "--version"], tmp_path / "log")
    assert engine.spec.env["INSTCLS_IMAGE"] == "localhost/instcls:9.9.9"  # not the manifest's placeholder
    printed = "instcls 9.9.9\ngit {} (dirty: uncommitted changes)\nimage localhost/instcls:9.9.9\n"
    assert re.search(version_pattern("localhost/instcls:9.9.9", "ab" * 20), printed.format("ab" * 20))
    assert not re.search(version_pattern("localhost/instcls:9.9.9", "ab" * 20), printed.format("cd" * 20))
    assert not re.search(version_pattern("localhost/instcls:9.9.9", None), printed.replace("9.9.9\n", "0.1.0\n"))
