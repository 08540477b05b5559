"""The package's version, from one source: ``pyproject.toml``, as the installed metadata records it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "instcls"


def package_version() -> str:
    """The installed distribution's version; a source tree that was never installed has none to read."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed: run `pip install -e .` in the repository)"
