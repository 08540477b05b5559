"""The export's ``README.md``: what the network is, how to load it (the snippet), what it was trained
on and how, how it scored, and the run's provenance (``run.json``, the resolved config)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from trainer.export.export_config import InputSpec

LOG_FILE = "rank-00000.jsonl"  # rank 0's log holds every evaluation


def checkpoint_scores(log_dir: Path, step: int) -> dict | None:
    """The run's evaluation at ``step`` (``{"event": "eval", "step": ..., "knn_trained": ...}`` in rank 0's
    log), or None when the run did not score that step or its log is not here."""
    path = Path(log_dir) / LOG_FILE
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a kill: the rest of the log still counts
            continue
        if isinstance(record, dict) and record.get("event") == "eval" and record.get("step") == step:
            found = record  # the last one: a resumed run may have scored the step again
    return found


def training_data(config, provenance: dict | None) -> dict[str, object]:
    """``{path, digest, images}`` of the training set: from ``run.json`` when it recorded it, else
    from the manifest the config names (``error`` says why neither could)."""
    if provenance and provenance.get("train_manifest"):
        return provenance["train_manifest"]
    from trainer.provenance import manifest_digest

    try:
        return manifest_digest(config.data.train_shards)
    except (OSError, ValueError) as error:
        return {"path": str(config.data.train_shards), "digest": None, "images": None, "error": str(error)}


def _percent(value) -> str:
    return "not scored" if value is None else f"{100 * value:.2f}%"


def _scores_lines(scores: dict | None, step: int) -> list[str]:
    if scores is None:
        return [f"Not scored: the run's log has no evaluation at step {step}."]
    start = "start (model.init_from)" if scores.get("baseline") == "init_from" else "random init"
    return [f"Scored by the run at step {step} on its held-out set (frozen backbone features):", "",
            f"| protocol | trained | {start} |", "|---|---|---|",
            f"| kNN | {_percent(scores.get('knn_trained'))} | {_percent(scores.get('knn_random_init'))} |",
            f"| linear probe | {_percent(scores.get('linear_trained'))} | "
            f"{_percent(scores.get('linear_random_init'))} |"]


def _objective_lines(objective) -> list[str]:
    fields = dataclasses.asdict(objective) if dataclasses.is_dataclass(objective) else vars(objective)
    return [f"- `{name}`: {value!r}" for name, value in fields.items()]


def model_card(config, exported: dict, snippet: str, meta: dict, scores: dict | None, provenance: dict | None,
               data: dict, spec: InputSpec, out_dir: Path, head: str | None = None) -> str:
    """The card's Markdown.  ``exported``: config.json; ``meta``: the checkpoint's trainer.json;
    ``head``: the head's snippet when the export has one."""
    info = exported["instcls"]
    library = info["library"]
    step = meta.get("global_step")
    per_image = info["input_norm"] == "per_image"
    norm = (" Each image is then standardised per channel (`torch.nn.functional.instance_norm`), as the run's "
            "`model.input_norm: per_image` did in training and evaluation." if per_image else "")
    lines = [
        f"# {info['arch']} trained by instcls ({config.objective.name})", "",
        f"An image backbone trained without labels by instcls, exported as {library}'s `{info['architecture']}` "
        f"with no classification layer: `network(images)` gives {info['width']}-wide features.", "",
        "## Files", "",
        f"- `model.safetensors`: the backbone's fp32 weights under {library}'s own names (`strict=True`).",
        "- `config.json`: " + ("timm's hub config (`architecture`, `model_args`, `pretrained_cfg`) and "
                               if library == "timm" else "") + "instcls's description (`instcls`).",
    ]
    if head is not None:
        lines.append("- `head.safetensors`: the projection head (`config.json` `instcls.head`).")
    if provenance is not None:
        lines.append("- `run.json`: the run's provenance, as the checkpoint holds it.")
    lines += [
        "", "## Use", "",
        f"Inputs are RGB images in [0, 1] of {spec.size} x {spec.size} pixels (instcls's evaluation resizes "
        f"the shorter side to {spec.resize} px, bilinear and antialiased, and centre-crops {spec.size}), "
        f"normalised with mean {list(spec.mean)} and std {list(spec.std)}.{norm} Run from this folder; it needs "
        f"torch, {library} and safetensors, not instcls:", "",
        "```python", snippet.rstrip("\n"), "```", "",
    ]
    if library == "timm":
        lines += ["timm also loads the folder by itself, offline (the same network and weights; apply the "
                  "normalisation above" + (" and the per-image standardisation" if norm else "") + " yourself):",
                  "", "```python", "import timm", "",
                  f'network = timm.create_model("local-dir:{Path(out_dir).resolve()}", pretrained=True).eval()',
                  "```", ""]
    if head is not None:
        lines += ["The projection head, after the snippet above:", "", "```python", head.rstrip("\n"), "```", ""]
    images = f"{data['images']} images" if data.get("images") is not None else "number of images unknown"
    digest = data.get("digest") or f"not available ({data.get('error')})"
    epochs = config.optim.epochs if hasattr(config, "optim") else "?"
    lines += [
        "## Training", "",
        f"- data: `{data.get('path')}`, {images}, manifest digest `{digest}`",
        f"- checkpoint: `{info['checkpoint']['path']}`, epoch {meta.get('epoch')} of {epochs}, global step {step}, "
        f"global batch {meta.get('global_batch', 'not recorded')}",
        *(["- network: the objective's momentum teacher (`teacher/model.pt`, its own BatchNorm statistics), not "
           "the trained student the scores below measure"] if info["checkpoint"].get("network") == "teacher" else []),
        f"- objective `{config.objective.name}`:", *[f"  {line}" for line in _objective_lines(config.objective)],
        "", "## Scores", "", *_scores_lines(scores, step), "",
        "## Provenance", "",
    ]
    from trainer.provenance import config_yaml, describe_provenance

    if provenance is None:
        lines += ["The checkpoint has no `run.json` (written before instcls recorded provenance). The config "
                  "given to `instcls export`, resolved:", "", "```yaml", config_yaml(config).rstrip("\n"), "```"]
    else:
        lines += ["```text", describe_provenance(provenance), "```", "", "The run's resolved config:", "",
                  "```yaml", str(provenance.get("config", "")).rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"
