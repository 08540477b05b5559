"""A run's provenance, ``run.json``: what made it, written at its start to ``logging.dir`` and
copied into every checkpoint it saves, so that a checkpoint or an export says which config,
overrides, code, libraries, hosts, data and starting weights produced it.

    {"format": 1, "config": "<the resolved config as YAML>", "config_file": ..., "overrides": [...],
     "instcls_version": ..., "git": {"commit": ..., "dirty": ...} | null, "image": ... | null,
     "versions": {...}, "world_size": ..., "hosts": [...], "started_at": "...Z", "run": token,
     "train_manifest": {"path", "digest", "images"}, "init_from": {"path", "digest"} | null,
     "resumed_from": path | null}

``instcls_version``, ``git`` and ``image`` are ``trainer.code_identity``'s: ``git`` from the checkout, else
from the commit the image was built from (null when neither: an installed wheel, an image built
without it); ``image`` is the pod's image reference (null outside the Kubernetes overlays).  Records
written before ``image`` was recorded have no such key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from enum import Enum
from pathlib import Path

import yaml

from trainer.code_identity import code_identity, describe_git, describe_image
from trainer.provenance.digests import file_sha256, manifest_digest
from trainer.temp_files import temp_sibling

RUN_FILE = "run.json"
FORMAT = 1
_LIBRARIES = {"torch": "torch", "deepspeed": "deepspeed", "nvidia-dali": "nvidia.dali", "timm": "timm",
              "triton": "triton", "torchvision": "torchvision"}


def config_as_data(value):
    """A config dataclass as plain YAML data (the same shape a config file has)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: config_as_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [config_as_data(item) for item in value]
    if isinstance(value, dict):
        return {str(key): config_as_data(item) for key, item in value.items()}
    if isinstance(value, (Path, str)):  # an S3Url is a str of its own type, which YAML cannot write
        return str(value)
    if isinstance(value, Enum):
        return value.value
    return value


def config_yaml(config) -> str:
    """The resolved job config (after overrides and defaults) as YAML that ``load_job_config`` reads back."""
    return yaml.safe_dump(config_as_data(config), sort_keys=False)


def _library_version(module: str) -> str | None:
    """The installed version of a library, without importing it (DALI and Triton are slow imports)."""
    from importlib.metadata import PackageNotFoundError, version

    distributions = {"nvidia.dali": ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali")}
    for name in distributions.get(module, (module,)):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def library_versions() -> dict[str, str | None]:
    """Versions of the libraries a run's numbers depend on (None: not installed)."""
    import platform

    return {"python": platform.python_version(), **{name: _library_version(module)
                                                   for name, module in _LIBRARIES.items()}}


def init_from_record(path: Path | None) -> dict | None:
    """``{path, digest}`` of the weights file a run starts from (``model.init_from``), or None."""
    if path is None:
        return None
    from trainer.checkpoint.initial_weights import weights_file

    file = weights_file(path)
    return {"path": str(file), "digest": file_sha256(file)}


def collect_provenance(config, config_file: Path | str | None, overrides: list[str] | None, world_size: int,
                       hosts: list[str], run: str | None, init_from: dict | None = None,
                       resumed_from: Path | None = None) -> dict:
    """This run's ``run.json`` (rank 0 computes it; ``hosts``: every rank's host name, in rank order;
    ``init_from``: ``init_from_record``'s, or the started-from record of the run it resumes)."""
    code = code_identity()
    return {
        "format": FORMAT,
        "config": config_yaml(config),
        "config_file": None if config_file is None else str(config_file),
        "overrides": list(overrides or []),
        "instcls_version": code["version"],
        "git": code["git"],
        "image": code["image"],
        "versions": library_versions(),
        "world_size": world_size,
        "hosts": list(hosts),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "run": run,
        "train_manifest": manifest_digest(config.data.train_shards),
        "init_from": init_from,
        "resumed_from": None if resumed_from is None else str(resumed_from),
    }


def host_name() -> str:
    return os.environ.get("HOSTNAME") or socket.gethostname()


def write_provenance(directory: Path, provenance: dict) -> Path:
    """``directory/run.json``, written atomically (a reader never sees half of it)."""
    path = Path(directory) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    tmp.write_text(json.dumps(provenance, indent=1))
    os.replace(tmp, path)
    return path


def read_provenance(directory: Path) -> dict | None:
    """The ``run.json`` of a log folder, a checkpoint or an export, or None when it has none
    (checkpoints written before provenance was recorded)."""
    path = Path(directory) / RUN_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is unreadable ({error}); it is the run's record, not needed to load weights: "
                         "delete it or restore it from the run's logging.dir") from error


def describe_provenance(provenance: dict) -> str:
    """Human lines for `instcls report` and the model card (without the config, shown apart)."""
    versions = ", ".join(f"{name} {value}" for name, value in provenance.get("versions", {}).items() if value)
    data = provenance.get("train_manifest") or {}
    init = provenance.get("init_from")
    lines = [
        f"instcls {provenance.get('instcls_version')}",
        describe_git(provenance.get("git")),
        describe_image(provenance["image"]) if "image" in provenance else "image not recorded (a run.json written "
        "before instcls recorded the image)",
        f"libraries: {versions}",
        f"started {provenance.get('started_at')} on {provenance.get('world_size')} ranks, hosts "
        f"{', '.join(sorted(set(provenance.get('hosts', []))))}",
        f"training data: {data.get('path')} ({data.get('images')} images, manifest {data.get('digest')})",
        f"config: {provenance.get('config_file')}" + (f" with --set {' --set '.join(provenance['overrides'])}"
                                                      if provenance.get("overrides") else ""),
        "started from: " + (f"{init['path']} ({init['digest']})" if init else "random init"),
    ]
    if provenance.get("resumed_from"):
        lines.append(f"resumed from: {provenance['resumed_from']}")
    return "\n".join(lines)
