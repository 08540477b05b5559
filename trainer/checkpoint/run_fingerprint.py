"""What a checkpoint's tensors depend on, recorded next to them so that resuming it under a config
that builds other shapes is one sentence naming the difference, not DeepSpeed's or torch's list
of mismatched keys.

Only what changes a saved tensor's shape or meaning is here: the backbone and head, D, N and the
objective (with its own shape settings, ``ObjectiveConfig.fingerprint_fields``).  The world size is
not: a checkpoint reshards onto any.  Settings like the learning rate may change on resume.
"""

from __future__ import annotations

MODEL_FIELDS = ("arch", "small_input_stem", "img_size", "patch_size", "pool", "input_norm", "head", "head_hidden_dim",
                "feature_dim")
FINGERPRINT_KEY = "fingerprint"  # in the checkpoint's trainer.json (the trainer's FieldsState fact)


def run_fingerprint(config, num_instances: int) -> dict[str, object]:
    """``{config path: value}`` of everything a checkpoint of this job depends on."""
    fingerprint: dict[str, object] = {f"model.{name}": getattr(config.model, name) for name in MODEL_FIELDS}
    fingerprint["data.train_shards (samples)"] = num_instances
    for name in config.objective.fingerprint_fields():
        fingerprint[f"objective.{name}"] = getattr(config.objective, name)
    return fingerprint


def fingerprint_mismatch(saved: dict[str, object], current: dict[str, object], checkpoint: str) -> str | None:
    """The sentence that stops a resume, or None when every recorded part matches."""
    differences = [f"{key} is {saved[key]!r} there and {current[key]!r} here"
                   for key in current if key in saved and saved[key] != current[key]]
    if not differences:
        return None
    return (f"checkpoint {checkpoint} was trained with another job: " + "; ".join(differences) +
            ". Resume it with the config it was trained with, or start a new run (--resume none, or another "
            "checkpoint.dir)")


def refuse_another_jobs_checkpoint(checkpoint, current: dict[str, object], model_only: bool = False) -> None:
    """Raise ``ValueError`` (one line for the user) when ``checkpoint``'s recorded fingerprint differs
    from ``current`` (only the network's part with ``model_only``: an evaluation reads the weights
    alone).  Checkpoints written before fingerprints were recorded pass."""
    from trainer.checkpoint.checkpoint_files import read_trainer_meta

    saved = read_trainer_meta(checkpoint).get(FINGERPRINT_KEY, {})
    if model_only:
        current = {key: value for key, value in current.items() if key.startswith("model.")}
    problem = fingerprint_mismatch(saved, current, str(checkpoint))
    if problem is not None:
        raise ValueError(problem)
