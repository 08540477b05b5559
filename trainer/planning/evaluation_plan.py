"""`instcls plan --config`: what the job's evaluation holds per rank at the end of the run, the linear
probe at the job's N by its method (``eval.linear``), next to the kNN it runs beside, and how long
extracting its features takes at a stated rate."""

from __future__ import annotations

import json

import torch

from trainer.evaluation.knn_memory import knn_peak_bytes
from trainer.evaluation.linear_sgd import linear_probe_bytes

MIB = 1 << 20
ASSUMED_CLASSES = 1000  # when the bank's manifest is not on this machine or names no classes


ASSUMED_QUERIES = 50_000  # ImageNet's validation set, when the eval shards' manifest is not here

# Images one GPU rank runs through feature extraction per second (inference loader + backbone forward),
# when `instcls plan --eval-images-per-second` does not say.  docs/benchmarks.md's GPU target for one
# 224 px view of ResNet-50 on an H100 (">= 3,500 images/s"); docs/gpu-results.md section 4 bounds it
# from measurements on an H200: the forward of 128 views took 16 ms (8,000 views/s), so the loader sets
# the pace, and the torchvision loader alone delivered 3,576 images/s.  A target, not a measured
# extraction: `instcls bench eval` on the job's machine gives the figure to pass instead.
EXTRACTION_IMAGES_PER_SECOND = 3_500.0
END_OF_RUN_NETWORKS = 2  # the trained network and its random init, each extracts the bank and the queries


def _manifest(shards) -> dict:
    """The manifest's fields, from a directory or an s3:// prefix; {} when it is not reachable from here."""
    from data_pipeline.contract import manifest_bytes

    try:
        return json.loads(manifest_bytes(shards)) if shards is not None else {}
    except (OSError, ValueError):  # not here, unreachable, refused: the plan assumes sizes and says so
        return {}


def _feature_width(model_config) -> int:
    from trainer.models.backbones import get_backbone

    with torch.device("meta"):
        return get_backbone(model_config.arch).build(model_config).width


def extraction_seconds(images: int, ranks: int, images_per_second: float, networks: int = 1) -> float:
    """Wall time for ``networks`` networks to extract features of ``images`` images, shared evenly by
    ``ranks`` ranks that each extract ``images_per_second``."""
    return networks * images / (ranks * images_per_second)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:,.1f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


def evaluation_time_lines(section, ranks: int, rows: int, queries: int, images_per_second: float) -> list[str]:
    """How long the evaluation's feature extraction takes (kNN scoring and the probe's fit not counted).
    The end of the run is counted with both networks: the random init's kNN, cached by an evaluation
    while training in the same process, is extracted again when the linear probe runs or after a resume."""
    rate = f"{images_per_second:,.0f} images/s per rank over {ranks:,} ranks"
    both = f"{END_OF_RUN_NETWORKS} networks (trained, random init) x (bank {rows:,} + queries {queries:,}) images"
    if section.knn_at_end or section.linear_at_end:
        seconds = extraction_seconds(rows + queries, ranks, images_per_second, END_OF_RUN_NETWORKS)
        lines = [f"  time at the end: {both} at {rate} ≈ {_duration(seconds)} of feature extraction"]
    else:
        lines = ["  time at the end: none (eval.knn_at_end and eval.linear_at_end are false)"]
    if section.every_epochs:
        seconds = extraction_seconds(rows + queries, ranks, images_per_second)
        lines.append(f"  every {section.every_epochs} epoch(s) while training: the trained network, "
                     f"{_duration(seconds)} each (the first evaluation also the random init)")
    return lines


def evaluation_plan_lines(config, ranks: int, bank_rows: int,
                          images_per_second: float = EXTRACTION_IMAGES_PER_SECOND) -> list[str]:
    """The lines ``instcls plan`` prints for the end-of-run evaluation of ``config`` on ``ranks``,
    with a bank of ``bank_rows`` samples (``eval.bank_samples`` caps it), its extraction timed at
    ``images_per_second`` per rank."""
    section = config.eval
    if config.data.eval_shards is None:
        return ["evaluation: off (data.eval_shards is unset)"]
    rows = min(bank_rows, section.bank_samples or bank_rows)
    width = _feature_width(config.model)
    found = len(_manifest(config.data.knn_bank_shards or config.data.train_shards).get("class_names") or [])
    classes = found or ASSUMED_CLASSES
    source = "the bank's manifest" if found else f"{ASSUMED_CLASSES} assumed: no class names in a manifest here"
    queries = _manifest(config.data.eval_shards).get("num_instances") or ASSUMED_QUERIES
    element_bytes = 2 if section.bank_dtype == "float16" else 4
    knn = knn_peak_bytes(queries, rows, width, section.knn_k, ranks, bank_element_bytes=element_bytes, classes=classes)
    lines = [f"evaluation: a bank of {rows:,} samples x {width} features, {classes:,} classes ({source}), "
             f"{queries:,} held-out samples",
             *evaluation_time_lines(section, ranks, rows, queries, images_per_second),
             f"  kNN per rank: {knn / MIB:,.1f} MiB"]
    at_end = "at the end of the run" if section.linear_at_end else "in `instcls eval linear` (linear_at_end: false)"
    linear = section.linear
    method = linear.method_for(rows)
    if method == "sklearn":
        gathered = rows * (width * 4 + 8)
        return lines + [f"  linear probe {at_end}: sklearn on rank 0: the bank gathered into its host memory, "
                        f"{gathered / MIB:,.1f} MiB, one CPU fit (eval.linear.method: sgd shares it over the ranks)"]
    heads = len(linear.learning_rates) * len(linear.weight_decays)
    parts = linear_probe_bytes(rows, width, classes, heads, linear.batch_size, ranks, element_bytes=element_bytes,
                               queries=queries, held_out=linear.held_out)
    total, bank, state, transient = (value / MIB for value in (sum(parts.values()), parts["bank_rows"],
                                                               parts["heads"], parts["transient"]))
    return lines + [f"  linear probe {at_end}, per rank (sgd, {heads} heads, batch {linear.batch_size:,}): "
                    f"{total:,.1f} MiB = its bank rows {bank:,.1f} + the heads' weights, momentum, gradient, "
                    f"decay and learning rate {state:,.1f} + the largest step, update or scored block "
                    f"{transient:,.1f}; each step all-reduces {heads * classes * (width + 1) * 4 / MIB:,.1f} MiB"]
