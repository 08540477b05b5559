"""Which code a process runs: the package version, the git commit and the container image.

    code_identity() -> {"version": "0.2.0",
                        "git": {"commit": "<hex>", "dirty": True | False | None} | None,
                        "image": "registry.example.com/instcls:0.2.0" | None}

- ``git``: from the checkout instcls runs from (``git rev-parse HEAD``; ``dirty``: tracked files
  differ from that commit). Outside a checkout (the image: ``.dockerignore`` keeps ``.git`` out of
  the build), from ``INSTCLS_GIT_COMMIT`` and ``INSTCLS_GIT_DIRTY``, which the Dockerfile sets from
  its build arguments of the same names (``make image`` and the documented ``docker build`` pass
  them). ``dirty`` is None when the build did not say; ``git`` is None when neither source has a commit.
- ``image``: ``INSTCLS_IMAGE``, which the Kubernetes overlays copy from the training container's own
  ``image`` field (kustomize ``replacements``; k8s/README.md). None when unset: not started by them.

No torch, no YAML, at most two ``git`` calls: ``instcls --version`` prints it, ``run.json`` and the
model card record it, and a tracker can tag runs with it.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

from trainer.version import package_version

GIT_COMMIT_VARIABLE = "INSTCLS_GIT_COMMIT"
GIT_DIRTY_VARIABLE = "INSTCLS_GIT_DIRTY"
IMAGE_VARIABLE = "INSTCLS_IMAGE"
_COMMIT = re.compile(r"[0-9a-f]{7,64}")  # abbreviated or full; SHA-1 (40) or SHA-256 (64) repositories
_DIRTY = {"true": True, "false": False, "": None}
_SOURCE = Path(__file__).resolve().parents[1]  # the folder above the trainer package: a checkout's root


def git_state(source: Path | None = None) -> dict | None:
    """``{commit, dirty}`` of the checkout at ``source`` (default: the one instcls runs from), or None
    (not a checkout, or no usable git)."""
    source = Path(source or _SOURCE)
    if not (source / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(changes.strip())}


def baked_git_state(environ: Mapping[str, str] | None = None) -> dict | None:
    """``{commit, dirty}`` from the image's build arguments (``INSTCLS_GIT_COMMIT``, ``INSTCLS_GIT_DIRTY``),
    or None when the image was built without a commit."""
    environ = os.environ if environ is None else environ
    commit = environ.get(GIT_COMMIT_VARIABLE, "").strip().lower()
    if not commit:
        return None
    if not _COMMIT.fullmatch(commit):
        raise ValueError(f"{GIT_COMMIT_VARIABLE}={environ[GIT_COMMIT_VARIABLE]!r} is not a git commit (7 to 64 hex "
                         f"digits): rebuild the image with --build-arg {GIT_COMMIT_VARIABLE}=$(git rev-parse HEAD), "
                         "or unset the variable")
    dirty = environ.get(GIT_DIRTY_VARIABLE, "").strip().lower()
    if dirty not in _DIRTY:
        raise ValueError(f"{GIT_DIRTY_VARIABLE}={environ[GIT_DIRTY_VARIABLE]!r} is neither true nor false: rebuild "
                         f"the image with --build-arg {GIT_DIRTY_VARIABLE}=true (uncommitted changes) or false")
    return {"commit": commit, "dirty": _DIRTY[dirty]}


def image_reference(environ: Mapping[str, str] | None = None) -> str | None:
    """The container image the pod runs (``INSTCLS_IMAGE``), or None outside the Kubernetes overlays."""
    environ = os.environ if environ is None else environ
    return environ.get(IMAGE_VARIABLE, "").strip() or None


def code_identity(source: Path | None = None, environ: Mapping[str, str] | None = None) -> dict:
    """``{"version", "git", "image"}`` as the module's docstring shows: the checkout's git state, else the
    image's baked one; the image from the environment."""
    return {"version": package_version(), "git": git_state(source) or baked_git_state(environ),
            "image": image_reference(environ)}


def describe_git(git: dict | None) -> str:
    if not git:
        return f"commit not recorded (not a git checkout, and no {GIT_COMMIT_VARIABLE} from the image build)"
    dirty = {True: " (dirty: uncommitted changes)", False: "", None: " (uncommitted changes not recorded)"}
    return f"git {git['commit']}{dirty[git.get('dirty')]}"


def describe_image(image: str | None) -> str:
    return f"image {image}" if image else f"image not recorded ({IMAGE_VARIABLE} unset: not started by k8s/overlays)"


def describe_code(identity: dict) -> str:
    """``instcls --version``'s lines: the version, then the commit, then the image."""
    return "\n".join([f"instcls {identity['version']}", describe_git(identity["git"]),
                      describe_image(identity["image"])])
