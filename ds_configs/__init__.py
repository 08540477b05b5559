"""The DeepSpeed configs shipped with instcls, installed with the package, and the rule that finds
the file a job config's ``deepspeed_config`` names, wherever the job runs from:

- a shipped name (``zero2_bf16``) or the spelling the shipped job configs use
  (``ds_configs/zero2_bf16.json``) is the shipped file, from the checkout or the installed package;
- an absolute path is that file;
- any other relative path is read relative to the job config's folder, else the working directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

FOLDER = "ds_configs"


def shipped_folder() -> Path:
    return Path(str(resources.files(__name__)))


def shipped_names() -> list[str]:
    return sorted(p.stem for p in shipped_folder().glob("*.json"))


def resolve(value: Path | str, config_folder: Path | None = None) -> Path:
    """The file ``value`` names under the rule above; ``ValueError`` naming where it looked."""
    path = Path(value)
    names = shipped_names()
    if len(path.parts) == 1 and path.suffix == "" and path.name in names:
        return shipped_folder() / f"{path.name}.json"
    if len(path.parts) == 2 and path.parts[0] == FOLDER and path.suffix == ".json" and path.stem in names:
        return shipped_folder() / path.name
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = ([Path(config_folder) / path] if config_folder is not None else []) + [Path.cwd() / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    looked = " and ".join(str(c) for c in dict.fromkeys(candidates))
    raise ValueError(f"deepspeed_config {value} not found (looked at {looked}); name a shipped config ("
                     f"{', '.join(names)}, or ds_configs/<name>.json), an absolute path, or a path relative to the "
                     "job config's folder or the working directory")
