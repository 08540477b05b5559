"""One version source: pyproject.toml, read at run time from the installed metadata and printed by
``instcls --version``."""

import re
import subprocess
from pathlib import Path

import pytest

from trainer.cli import main
from trainer.version import package_version


def _pyproject_version() -> str:
    """The ``version =`` line of the ``[project]`` table (tomllib is not in Python 3.10's library)."""
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    return re.search(r'^version = "([^"]+)"$', project, re.MULTILINE).group(1)


def test_installed_version_is_the_pyproject_version():
    assert package_version() == _pyproject_version()


def _printed_version(capsys) -> list[str]:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    return capsys.readouterr().out.splitlines()


def test_cli_prints_the_version_commit_and_image_and_exits_cleanly(capsys, monkeypatch, tmp_path):
    """In the checkout: its HEAD; in a pod: the image the overlay copied into INSTCLS_IMAGE; outside a
    checkout (the image): the commit the build was given."""
    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    monkeypatch.setenv("INSTCLS_IMAGE", "registry.example.com/instcls:" + _pyproject_version())
    version, commit, image = _printed_version(capsys)
    assert version == f"instcls {_pyproject_version()}"
    assert re.fullmatch(rf"git {head}( \(dirty: uncommitted changes\))?", commit)
    assert image == f"image registry.example.com/instcls:{_pyproject_version()}"

    monkeypatch.setattr("trainer.code_identity._SOURCE", tmp_path)  # as installed in the image: no .git
    monkeypatch.setenv("INSTCLS_GIT_COMMIT", "ab" * 20)
    monkeypatch.setenv("INSTCLS_GIT_DIRTY", "false")
    monkeypatch.delenv("INSTCLS_IMAGE")
    assert _printed_version(capsys)[1:] == ["git " + "ab" * 20, "image not recorded (INSTCLS_IMAGE unset: not "
                                                                "started by k8s/overlays)"]


def test_changelog_has_a_section_for_the_current_version():
    """Keep a Changelog: every released version has a dated section; the current one is listed."""
    changelog = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
    assert f"## [{_pyproject_version()}] - " in changelog


def test_every_place_that_names_the_version_names_the_pyproject_version():
    """CITATION.cff, the image tag kustomize sets and the docs' build commands repeat the version:
    a release that bumps pyproject.toml alone fails here (CONTRIBUTING.md lists the places)."""
    root = Path(__file__).resolve().parents[2]
    version = _pyproject_version()
    assert re.search(r"^version: (\S+)$", (root / "CITATION.cff").read_text(), re.MULTILINE).group(1) == version
    assert f"\n  newTag: {version}\n" in (root / "k8s/base/kustomization.yaml").read_text()
    files = [root / "README.md", root / "Dockerfile", *sorted((root / "docs").glob("*.md")),
             *sorted((root / "k8s").glob("*.md")), root / "k8s/base/kustomization.yaml"]
    tags = {(path.relative_to(root).as_posix(), tag) for path in files
            for tag in re.findall(r"instcls:(\d+\.\d+\.\d+)", path.read_text())}
    assert {path for path, _ in tags} >= {"README.md", "Dockerfile", "docs/cluster.md", "k8s/README.md"}
    assert not {(path, tag) for path, tag in tags if tag != version}, f"image tags that are not {version}"
