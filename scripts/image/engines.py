"""Building and running the image with what the machine has: Docker when a daemon answers, else
buildah (Debian's package, installed when missing and root) with chroot isolation.

Buildah is the fallback for machines without a daemon (CI sandboxes, this repository's build
machine): it builds the same Dockerfile, from a base made locally with mmdebstrap when no
registry can be reached (``base_image.py``).  ``buildah run`` is not a container runtime's run:
it cannot make the root file system read-only or apply seccomp, which ``check.py`` makes up for
where it can and names where it cannot.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# The host's CA bundle, mounted into the build's RUN steps: behind a TLS-intercepting proxy pip
# trusts the proxy only through it.  Mounted, never copied: the image keeps its own bundle.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


class ImageToolError(RuntimeError):
    """Neither engine can run here, or one of their commands failed."""


def run_command(argv: list[str], capture: bool = False, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """``argv``, echoed first; a failure raises ImageToolError naming the command."""
    print("+ " + shlex.join(argv), flush=True)
    result = subprocess.run(argv, text=True, capture_output=capture, **kwargs)
    if check and result.returncode:
        detail = f":\n{result.stderr.strip()}" if capture and result.stderr else ""
        raise ImageToolError(f"`{shlex.join(argv)}` exited {result.returncode}{detail}")
    return result


@dataclass(frozen=True)
class RunSpec:
    """One command in the image: as ``user:group`` in ``working_dir`` (None: the image's), with
    ``env`` and ``volumes`` (host path -> (container path, read-only)), on a read-only root file
    system where the engine can mount one and ``read_only_root`` asks."""

    argv: tuple[str, ...]
    user: str
    working_dir: str | None
    env: dict[str, str] = field(default_factory=dict)
    volumes: dict[str, tuple[str, bool]] = field(default_factory=dict)
    read_only_root: bool = True

    def options(self, working_dir_flag: str) -> list[str]:
        """The working directory, environment and volumes as ``docker run`` / ``buildah run`` flags
        (they differ only in the working directory's)."""
        argv = [working_dir_flag, self.working_dir] if self.working_dir else []
        for name, value in self.env.items():
            argv += ["--env", f"{name}={value}"]
        for host, (path, read_only) in self.volumes.items():
            argv += ["--volume", f"{host}:{path}" + (":ro" if read_only else "")]
        return argv


def build_arg_flags(build_args: dict[str, str] | None) -> list[str]:
    """``--build-arg NAME=VALUE`` for each, as both ``docker build`` and ``buildah bud`` take them."""
    return [flag for name, value in (build_args or {}).items() for flag in ("--build-arg", f"{name}={value}")]


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


class Docker:
    name = "docker"
    enforces_read_only_root = True  # --read-only

    def build(self, tag: str, context: Path, build_args: dict[str, str] | None = None) -> None:
        run_command(["docker", "build", *build_arg_flags(build_args), "-t", tag, str(context)])

    def size(self, tag: str) -> str:
        size = int(run_command(["docker", "image", "inspect", "-f", "{{.Size}}", tag], capture=True).stdout)
        return f"{size / 1e9:.2f} GB"

    def start(self, tag: str) -> str:
        return tag  # every run is a fresh container of the image

    def run(self, handle: str, spec: RunSpec, capture: bool = False) -> subprocess.CompletedProcess:
        argv = ["docker", "run", "--rm", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "--user", spec.user, "--entrypoint", spec.argv[0]] + (["--read-only"] if spec.read_only_root else [])
        argv += spec.options("--workdir")
        return run_command(argv + [handle, *spec.argv[1:]], capture=capture, check=False)

    def root_files(self, handle: str) -> None:
        return None  # Docker enforces the read-only root itself

    def stop(self, handle: str) -> None:
        pass


class Buildah:
    name = "buildah"
    enforces_read_only_root = False  # checked instead: ``root_files`` before and after

    def build(self, tag: str, context: Path, build_args: dict[str, str] | None = None) -> None:
        argv = ["buildah", "bud", "--isolation", "chroot", "--pull=never", "--layers", *build_arg_flags(build_args),
                "-t", tag]
        if HOST_CA_BUNDLE.exists():
            argv += ["--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
        run_command(argv + [str(context)])

    def size(self, tag: str) -> str:
        """As ``buildah images`` gives it (e.g. "7.51 GB"): buildah reports no byte count."""
        images = json.loads(run_command(["buildah", "images", "--json", tag], capture=True).stdout)
        return images[0]["size"]

    def start(self, tag: str) -> str:
        """A working container of ``tag``; every run of the check runs in it, as in one pod."""
        return run_command(["buildah", "from", "--pull=never", tag], capture=True).stdout.strip()

    def run(self, handle: str, spec: RunSpec, capture: bool = False) -> subprocess.CompletedProcess:
        argv = ["buildah", "run", "--isolation", "chroot", "--cap-drop", "ALL", "--user", spec.user]
        argv += spec.options("--workingdir")
        return run_command(argv + [handle, "--", *spec.argv], capture=capture, check=False)

    def root_files(self, handle: str) -> dict[str, tuple[int, int]]:
        """Every path of the container's root file system with its (mtime_ns, size), directories
        with (0, 0): compared before and after the pod's commands, what a read-only root would have
        refused.  A directory's own times change when ``buildah run`` makes and removes its mount
        points under it (/run), so a directory counts only by being there or not."""
        root = Path(run_command(["buildah", "mount", handle], capture=True).stdout.strip())
        files = {}
        for directory, names, file_names in os.walk(root):
            for name in names + file_names:
                path = Path(directory) / name
                status = path.lstat()  # one stat per path: an image root holds tens of thousands
                key = "/" + str(path.relative_to(root))
                files[key] = (0, 0) if stat.S_ISDIR(status.st_mode) else (status.st_mtime_ns, status.st_size)
        return files

    def stop(self, handle: str) -> None:
        run_command(["buildah", "rm", handle], capture=True, check=False)


def install_buildah() -> None:
    """Debian's buildah and mmdebstrap (bookworm: buildah 1.28), as root."""
    missing = [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise ImageToolError(f"no Docker daemon answers and {' and '.join(missing)} are missing; install them "
                             "(Debian/Ubuntu: apt-get install buildah mmdebstrap) or start Docker")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run_command(["apt-get", "update", "-qq"], env=env)
    run_command(["apt-get", "install", "-y", "-qq", "buildah", "mmdebstrap"], env=env)


NOT_ROOT = ("no Docker daemon answers and this is not root: buildah's fallback installs packages and mounts "
            "file systems as root (run as root, or start Docker)")


def unavailable_reason() -> str | None:
    """Why neither engine can run here, or None when one can."""
    return None if docker_answers() or os.geteuid() == 0 else NOT_ROOT


def pick_engine() -> Docker | Buildah:
    """Docker when its daemon answers; else buildah, installed when missing (root only)."""
    if docker_answers():
        return Docker()
    if os.geteuid() != 0:
        raise ImageToolError(NOT_ROOT)
    install_buildah()
    return Buildah()
