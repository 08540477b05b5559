"""The Dockerfile's base image, made locally when no registry can be reached: Debian bookworm
(minbase) with its Python 3.11, pip and ``python``/``pip`` on the path, built by mmdebstrap from
the Debian mirror and stored under the Dockerfile's ``FROM`` name, so that ``buildah bud
--pull=never`` builds the unchanged Dockerfile on it.

It stands in for ``python:3.11-slim-bookworm``: the same Debian release and Python minor version,
Debian's interpreter (``/usr/bin/python3``) instead of the official image's ``/usr/local`` build.
Like the official image it carries Python's headers (inductor compiles C++ against them).
Debian marks its Python "externally managed" (PEP 668), which would refuse the Dockerfile's
``pip install``; the official image has no such marker, so neither has this one.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from scripts.image.engines import run_command

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"
# python3-dev: the official image carries Python's headers, which inductor's C++ kernels include.
PACKAGES = ("python3", "python3-dev", "python3-pip", "python-is-python3", "ca-certificates")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def dockerfile_base(dockerfile: Path = DOCKERFILE) -> str:
    """The fully qualified name of the Dockerfile's first ``FROM`` (Docker Hub's short names
    qualified as Docker does: ``python:3.11`` is ``docker.io/library/python:3.11``)."""
    for line in dockerfile.read_text().splitlines():
        match = re.match(r"\s*FROM\s+(?:--platform=\S+\s+)?(\S+)", line, re.IGNORECASE)
        if match:
            name = match.group(1)
            first = name.split("/")[0]
            if "/" not in name:
                return f"docker.io/library/{name}"
            if "." not in first and ":" not in first and first != "localhost":
                return f"docker.io/{name}"
            return name
    raise ValueError(f"{dockerfile} has no FROM line")


def debian_suite(base: str) -> str:
    """The Debian release a ``python:*-<suite>`` tag names (bookworm, trixie, ...)."""
    match = re.search(r"-(bookworm|trixie|bullseye)$", base)
    if not match:
        raise ValueError(f"cannot make {base} locally: only python:*-slim-<debian release> bases are supported")
    return match.group(1)


def base_exists(name: str) -> bool:
    return run_command(["buildah", "inspect", "--type", "image", name], capture=True, check=False).returncode == 0


def make_base(name: str) -> None:
    """mmdebstrap a minbase root file system with Python, and commit it as the image ``name`` (~1 min)."""
    suite = debian_suite(name)
    with tempfile.TemporaryDirectory(prefix="instcls-base-", dir="/var/tmp") as scratch:
        tarball = Path(scratch) / "base.tar"
        run_command(["mmdebstrap", "--variant=minbase", "--include=" + ",".join(PACKAGES),
                     '--customize-hook=rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED', suite, str(tarball)])
        container = run_command(["buildah", "from", "scratch"], capture=True).stdout.strip()
        try:
            run_command(["buildah", "add", container, str(tarball), "/"])  # a local tar is unpacked
            run_command(["buildah", "config", "--env", f"PATH={PATH}", "--env", "LANG=C.UTF-8", "--cmd", "python3",
                         container])
            run_command(["buildah", "commit", "--rm", container, name])
        except BaseException:
            run_command(["buildah", "rm", container], capture=True, check=False)
            raise


def ensure_base() -> str:
    """The Dockerfile's base in the local store, made once; its name."""
    name = dockerfile_base()
    if base_exists(name):
        print(f"base image {name}: in the local store", flush=True)
    else:
        print(f"base image {name}: not in the local store, making it with mmdebstrap", flush=True)
        make_base(name)
    return name
