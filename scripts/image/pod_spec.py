"""What the Kubernetes pod runs, read from the training manifest, so that `make image-check` runs the
image the same way: the container's command and arguments, its environment, working directory,
user and group, the paths it mounts (and which of them are read-only), and whether its root file
system is read-only.  One source: a change to the manifest changes the check.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

MANIFEST = Path(__file__).resolve().parents[2] / "k8s" / "overlays" / "pytorchjob" / "pytorchjob.yaml"


@dataclass(frozen=True)
class Mount:
    path: str
    read_only: bool


@dataclass(frozen=True)
class PodSpec:
    command: tuple[str, ...]
    env: dict[str, str]
    working_dir: str | None  # None: the image's WORKDIR
    user: int
    group: int
    mounts: tuple[Mount, ...]
    read_only_root: bool

    def mount(self, path: str) -> Mount:
        for mount in self.mounts:
            if mount.path == path:
                return mount
        raise KeyError(f"the pod mounts no volume at {path} (it mounts {', '.join(m.path for m in self.mounts)})")


def read_pod_spec(manifest: Path = MANIFEST, replica: str = "Master") -> PodSpec:
    """The spec of ``replica``'s first container in the PyTorchJob ``manifest``."""
    job = yaml.safe_load(manifest.read_text())
    try:
        pod = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]
        container = pod["containers"][0]
    except (KeyError, IndexError, TypeError) as error:
        raise ValueError(f"{manifest}: no spec.pytorchReplicaSpecs.{replica}.template.spec.containers[0] "
                         f"({error!r}); the image check reads the pod's command from there") from error
    pod_security = pod.get("securityContext") or {}
    container_security = container.get("securityContext") or {}
    user = container_security.get("runAsUser", pod_security.get("runAsUser"))
    group = container_security.get("runAsGroup", pod_security.get("runAsGroup", user))
    if user is None:
        raise ValueError(f"{manifest}: {replica}'s pod sets no runAsUser; the image check runs as the pod's user")
    env = {}
    for variable in container.get("env") or []:
        if "value" not in variable:
            raise ValueError(f"{manifest}: env {variable.get('name')!r} is not a plain value (valueFrom is not "
                             "supported by the image check)")
        env[variable["name"]] = str(variable["value"])
    mounts = tuple(Mount(m["mountPath"], bool(m.get("readOnly", False))) for m in container.get("volumeMounts") or [])
    return PodSpec(command=tuple(container.get("command") or ()) + tuple(container.get("args") or ()), env=env,
                   working_dir=container.get("workingDir"), user=int(user), group=int(group), mounts=mounts,
                   read_only_root=bool(container_security.get("readOnlyRootFilesystem", False)))
