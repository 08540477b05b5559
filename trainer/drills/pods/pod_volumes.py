"""A pod's volumes on this machine: each mount path a directory in the pod's own directory.  A
ConfigMap's files are written there (from the fixtures the test supplied), an ``emptyDir`` is a
fresh directory, a claim is a link to the one directory of that claim every pod shares.  The
mounted files name mount paths too (the job config's shards and checkpoints): they are rewritten
to the pod's relative paths, as the arguments are (``cpu_substitutions.rewrite_paths``)."""

from __future__ import annotations

from pathlib import Path

from trainer.drills.pods import cpu_substitutions as cpu
from trainer.drills.pods.manifest import ManifestError, PodTemplate


def mount_volumes(pod: PodTemplate, directory: Path, shared: Path, config_maps: dict[str, dict[str, str]],
                  changes: cpu.Changes) -> dict[str, str]:
    """Mount path -> the path relative to ``directory`` it becomes, every volume made."""
    volumes = {volume["name"]: volume for volume in pod.spec.get("volumes", [])}
    mounts = {}
    for mount in pod.container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        where = f"pod {pod.name} volumeMounts {mount['name']}"
        if volume is None:
            raise ManifestError(f"{where}: no volume of that name in spec.volumes")
        local = "mnt" + mount["mountPath"]
        path = directory / local
        path.parent.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            name = volume["configMap"]["name"]
            if name not in config_maps:
                raise ManifestError(f"{where}: ConfigMap {name!r} is not among the fixtures the test supplied "
                                    f"({sorted(config_maps)})")
            path.mkdir()
            for key, text in config_maps[name].items():
                (path / key).write_text(text)
        elif "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            (shared / claim).mkdir(parents=True, exist_ok=True)
            path.symlink_to((shared / claim).resolve(), target_is_directory=True)
        elif "emptyDir" in volume:
            path.mkdir()
        else:
            raise ManifestError(f"{where}: volume kind {sorted(set(volume) - {'name'})} is not one the harness "
                                "supplies (configMap, persistentVolumeClaim, emptyDir)")
        mounts[mount["mountPath"]] = local
        changes.note(f"pod {pod.name}", f"mount {mount['mountPath']} -> {local} in the pod's directory")
    _rewrite_mounted_files(directory, mounts)
    return mounts


def _rewrite_mounted_files(directory: Path, mounts: dict[str, str]) -> None:
    for local in mounts.values():
        if (directory / local).is_dir() and not (directory / local).is_symlink():
            for file in (directory / local).iterdir():
                if file.is_file():
                    file.write_text(cpu.rewrite_paths(file.read_text(), mounts))
