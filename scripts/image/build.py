"""`make image`: build the Dockerfile as ``instcls:<version>`` with Docker, or with buildah on a
base made locally (``base_image.py``) when no Docker daemon answers, telling the build the
checkout's commit (``INSTCLS_GIT_COMMIT``, ``INSTCLS_GIT_DIRTY``: the image has no ``.git``).
Prints the image's size."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from scripts.image.base_image import ensure_base
from scripts.image.engines import Buildah, Docker, ImageToolError, pick_engine
from trainer.code_identity import GIT_COMMIT_VARIABLE, GIT_DIRTY_VARIABLE, git_state

ROOT = Path(__file__).resolve().parents[2]


def package_version() -> str:
    match = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    if not match:
        raise ImageToolError("pyproject.toml has no version = \"...\" line to tag the image with")
    return match.group(1)


def default_tag() -> str:
    return f"localhost/instcls:{package_version()}"


def commit_build_args(source: Path = ROOT) -> dict[str, str]:
    """The Dockerfile's build arguments that name the checkout's commit; none outside a checkout."""
    git = git_state(source)
    if git is None:
        return {}
    return {GIT_COMMIT_VARIABLE: git["commit"], GIT_DIRTY_VARIABLE: str(git["dirty"]).lower()}


def build_image(tag: str) -> Docker | Buildah:
    """Build ``tag`` from the repository's Dockerfile; the engine that did."""
    engine = pick_engine()
    build_args = commit_build_args()
    print(f"building {tag} with {engine.name}, " + (f"commit {build_args[GIT_COMMIT_VARIABLE]}" if build_args else
                                                     f"no commit ({ROOT} is not a git checkout)"), flush=True)
    if isinstance(engine, Buildah):
        ensure_base()
    started = time.monotonic()
    engine.build(tag, ROOT, build_args)
    print(f"built {tag} with {engine.name} in {time.monotonic() - started:.0f} s: "
          f"{engine.size(tag)}", flush=True)
    return engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default=None, help="image name (default localhost/instcls:<package version>)")
    args = parser.parse_args(argv)
    try:
        build_image(args.tag or default_tag())
    except ImageToolError as error:
        print(f"make image: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
