"""One version source: pyproject.toml, read at run time from the installed metadata and printed by
``instcls --version``."""

import re
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


def test_cli_prints_the_version_and_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.split() == ["instcls", _pyproject_version()]


def test_changelog_has_a_section_for_the_current_version():
    """Keep a Changelog: every released version has a dated section; the current one is listed."""
    changelog = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
    assert f"## [{_pyproject_version()}] - " in changelog
