"""The job config that `instcls export` and `instcls eval` use for a checkpoint: the run's own,
resolved config from the checkpoint's ``run.json``, or a ``--config`` given beside it, checked
against that record.

A given config (and ``--set``) may change anything that leaves the network as it is: data paths,
evaluation settings, logging, devices; the given values win.  A field that builds another network
(``NETWORK_FIELDS``: the backbone and its stem, grid and pooling, the input normalisation, the head
and its widths) is refused, naming the field and both values: the checkpoint's weights belong to
the recorded network.  A checkpoint written before runs recorded ``run.json`` needs ``--config``.
"""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.run_fingerprint import MODEL_FIELDS

# What changes the network's parameters or its forward; the other model fields (batch_norm,
# channels_last, compile, activation_checkpointing, init_from, init_strict, init_from_part) change how it trains.
NETWORK_FIELDS = tuple(f"model.{name}" for name in MODEL_FIELDS)
NEEDS_CONFIG = "pass --config FILE with the run's config (and the --set values it was trained with)"


def recorded_config(provenance: dict, overrides: list[str] | tuple[str, ...] = ()):
    """The resolved ``JobConfig`` a ``run.json`` holds, with ``overrides`` (``section.field=value``)
    applied.  ``ValueError`` when it does not load here (a field renamed or removed since the run,
    an override that is invalid)."""
    import yaml

    from trainer.config import JobConfig, apply_overrides
    from trainer.config_building import build_dataclass

    try:
        data = yaml.safe_load(provenance["config"]) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"its config is not valid YAML ({error})") from None
    return build_dataclass(JobConfig, apply_overrides(data, list(overrides)), "")


def _field(config, path: str):
    value = config
    for name in path.split("."):
        value = getattr(value, name)
    return value


def network_difference(recorded, given) -> tuple[str, object, object] | None:
    """The first ``(field, recorded value, given value)`` of ``NETWORK_FIELDS`` on which two configs
    differ, or None when they build the same network."""
    for path in NETWORK_FIELDS:
        before, after = _field(recorded, path), _field(given, path)
        if before != after:
            return path, before, after
    return None


def _source(config_file: Path | None, overrides: list[str]) -> str:
    if config_file is None:
        return "--set " + " --set ".join(overrides)
    return f"--config {config_file}" + (" with its --set values" if overrides else "")


def config_for_checkpoint(checkpoint: Path, config_file: Path | None, overrides: list[str]):
    """The ``JobConfig`` to export or evaluate ``checkpoint`` with: ``config_file`` with ``overrides``
    when given (its network checked against the checkpoint's ``run.json``, when it has one that still
    loads), else the ``run.json``'s resolved config with ``overrides``.  ``ValueError``, one line
    naming the fix: no ``run.json`` and no ``config_file``, or a network field that differs."""
    from trainer.config import load_job_config
    from trainer.provenance.run_provenance import RUN_FILE, read_provenance

    provenance = read_provenance(checkpoint)
    has_record = bool(provenance and provenance.get("config"))
    recorded = None
    if config_file is None:
        if not has_record:
            raise ValueError(f"checkpoint {checkpoint} has no {RUN_FILE} holding its config (it was written before "
                             f"runs recorded one): {NEEDS_CONFIG}")
        try:
            recorded = recorded_config(provenance)
        except ValueError as error:
            raise ValueError(f"the config in {Path(checkpoint) / RUN_FILE} does not load with this instcls: {error}; "
                             f"{NEEDS_CONFIG}") from None
        given = recorded_config(provenance, overrides) if overrides else recorded
    else:
        given = load_job_config(config_file, overrides)
        if has_record:
            try:
                recorded = recorded_config(provenance)
            except ValueError:  # an older record: trainer.json's fingerprint still guards the network
                recorded = None
    difference = None if recorded is None else network_difference(recorded, given)
    if difference is not None:
        field, before, after = difference
        raise ValueError(f"{field} is {before!r} in checkpoint {checkpoint} ({RUN_FILE}) and {after!r} in "
                         f"{_source(config_file, overrides)}: that is another network than the checkpoint's weights; "
                         f"drop {field} from what you pass (without --config the checkpoint's own config is used)")
    return given


def checkpoint_and_config(name: str, config_file: Path | None, overrides: list[str]):
    """``(checkpoint folder, JobConfig)`` for ``--checkpoint NAME``: a checkpoint folder, or "auto"
    (the newest complete one in the config's ``checkpoint.dir``, which needs ``config_file``)."""
    from trainer.checkpoint.checkpoint_files import TRAINER_FILE, resolve_resume

    if name == "auto":
        if config_file is None:
            raise ValueError("--checkpoint auto takes the newest complete checkpoint in the config's checkpoint.dir: "
                             "add --config FILE, or name the checkpoint folder (--checkpoint "
                             "CHECKPOINT_DIR/step_NNNNNNNNN), whose run.json holds the run's config")
        from trainer.config import load_job_config

        directory = load_job_config(config_file, overrides).checkpoint.dir
        checkpoint = resolve_resume("auto", directory)
        if checkpoint is None:
            raise FileNotFoundError(f"no complete checkpoint in {directory}: train first, or name one with "
                                    "--checkpoint DIR")
    else:
        if not (Path(name) / TRAINER_FILE).is_file():
            raise FileNotFoundError(f"--checkpoint {name}: not a complete checkpoint (no {TRAINER_FILE}): name a "
                                    "checkpoint folder (checkpoint.dir/step_NNNNNNNNN), or auto with --config")
        checkpoint = resolve_resume(name, Path("."))  # refuses a damaged one
    return checkpoint, config_for_checkpoint(checkpoint, config_file, overrides)
