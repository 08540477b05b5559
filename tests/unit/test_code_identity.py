"""Which code a run ran: the commit comes from the checkout, else from the build arguments the image
was built with (it holds no .git), and the image from the pod's INSTCLS_IMAGE; the Dockerfile and the
documented build commands pass the commit in."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.code_identity import (
    GIT_COMMIT_VARIABLE,
    GIT_DIRTY_VARIABLE,
    IMAGE_VARIABLE,
    baked_git_state,
    code_identity,
    git_state,
)

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def head_commit() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_an_installed_copy_without_git_names_the_commit_the_image_was_built_with(tmp_path):
    """The image's layout: the package outside any checkout, the build arguments as variables. A
    separate interpreter imports the copy, so the default source folder is the real one."""
    (tmp_path / "trainer").mkdir()
    for name in ("__init__.py", "version.py", "code_identity.py"):
        shutil.copyfile(REPO / "trainer" / name, tmp_path / "trainer" / name)
    program = ("import json, trainer.code_identity as c; "
               "print(json.dumps({'file': c.__file__, 'identity': c.code_identity()}))")

    def identity(**variables):
        env = {key: value for key, value in os.environ.items()
               if key not in (GIT_COMMIT_VARIABLE, GIT_DIRTY_VARIABLE, IMAGE_VARIABLE)}
        env.update(PYTHONPATH=str(tmp_path), **variables)
        result = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=60, check=True)
        found = json.loads(result.stdout)
        assert found["file"].startswith(str(tmp_path))  # the copy, not the checkout's package
        return found["identity"]

    baked = identity(**{GIT_COMMIT_VARIABLE: COMMIT, GIT_DIRTY_VARIABLE: "false",
                        IMAGE_VARIABLE: "registry.example.com/instcls@sha256:" + "ab" * 32})
    assert baked["git"] == {"commit": COMMIT, "dirty": False}
    assert baked["image"] == "registry.example.com/instcls@sha256:" + "ab" * 32
    assert identity(**{GIT_COMMIT_VARIABLE: "", GIT_DIRTY_VARIABLE: ""}) | {"version": None} == {
        "version": None, "git": None, "image": None}  # built without the arguments (the Dockerfile's defaults)


def test_the_baked_variables_are_read_and_checked(tmp_path):
    def git(**variables):
        return code_identity(source=tmp_path, environ=variables)["git"]

    assert git(INSTCLS_GIT_COMMIT=COMMIT.upper(), INSTCLS_GIT_DIRTY="True") == {"commit": COMMIT, "dirty": True}
    assert git(INSTCLS_GIT_COMMIT=COMMIT) == {"commit": COMMIT, "dirty": None}  # the build did not say
    assert git(INSTCLS_GIT_COMMIT=COMMIT[:12], INSTCLS_GIT_DIRTY="false") == {"commit": COMMIT[:12], "dirty": False}
    assert git(INSTCLS_GIT_DIRTY="true") is None  # no commit, nothing to qualify
    with pytest.raises(ValueError, match=r"INSTCLS_GIT_COMMIT='HEAD' is not a git commit .* --build-arg "
                                         r"INSTCLS_GIT_COMMIT=\$\(git rev-parse HEAD\)"):
        baked_git_state({GIT_COMMIT_VARIABLE: "HEAD"})
    with pytest.raises(ValueError, match=r"INSTCLS_GIT_DIRTY='yes' is neither true nor false"):
        baked_git_state({GIT_COMMIT_VARIABLE: COMMIT, GIT_DIRTY_VARIABLE: "yes"})


def test_a_checkout_names_its_own_commit_whatever_the_variables_say(tmp_path):
    identity = code_identity(source=REPO, environ={GIT_COMMIT_VARIABLE: COMMIT, IMAGE_VARIABLE: " reg/instcls:1 "})
    assert identity["git"]["commit"] == head_commit() and isinstance(identity["git"]["dirty"], bool)
    assert identity["image"] == "reg/instcls:1"
    assert git_state(tmp_path) is None
    assert code_identity(source=tmp_path, environ={IMAGE_VARIABLE: ""}) | {"version": None} == {
        "version": None, "git": None, "image": None}


def test_the_dockerfile_turns_its_commit_arguments_into_the_variables_instcls_reads():
    """Statically, as no Docker daemon runs here: each argument declared after every RUN and COPY (a new
    commit must not rebuild the dependency layers), then kept as a variable of the same name."""
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    last_build_step = max(i for i, line in enumerate(instructions) if line.split()[0] in ("RUN", "COPY", "FROM"))
    text = "\n".join(instructions).replace("\\\n", " ")
    for name in (GIT_COMMIT_VARIABLE, GIT_DIRTY_VARIABLE):
        declared = [i for i, line in enumerate(instructions) if re.fullmatch(rf'ARG {name}(="")?', line)]
        assert declared and declared[0] > last_build_step, name
        assert re.search(rf"^ENV .*\b{name}=\$\{{{name}\}}", text, re.M), name
    assert ".git" in (REPO / ".dockerignore").read_text().split()  # why the build must be told


def test_every_documented_image_build_passes_the_commit():
    """Each `docker build ... -t` command in the docs, the Dockerfile and k8s/base (backslash-continued
    lines joined) gives INSTCLS_GIT_COMMIT from `git rev-parse HEAD`."""
    files = [REPO / "README.md", REPO / "Dockerfile", REPO / "k8s/README.md", REPO / "k8s/base/kustomization.yaml",
             *sorted((REPO / "docs").glob("*.md"))]
    commands = []
    for path in files:
        text = re.sub(r"\\\n[#\s]*", " ", path.read_text())
        commands += [(path.name, command) for command in re.findall(r"docker build [^\n`]*", text) if " -t " in command]
    assert {name for name, _ in commands} >= {"README.md", "Dockerfile", "cluster.md", "kustomization.yaml"}
    assert len([name for name, _ in commands if name == "README.md"]) >= 2  # the repository's and k8s/'s
    for name, command in commands:
        assert "--build-arg INSTCLS_GIT_COMMIT=$(git rev-parse HEAD)" in command, (name, command)
