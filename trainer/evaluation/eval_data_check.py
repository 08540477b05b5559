"""Evaluation's inputs checked when a run starts, not when it evaluates: a run whose held-out set or
bank has no labels used to fail at its first evaluation, by default after its last epoch, and exit
2 with its training done.

With ``data.eval_shards`` set, the bank (``data.knn_bank_shards``, else the training shards; only the
``eval.bank_samples`` subset when set) and the queries (``data.eval_shards``) must exist, carry a
label on every sample, hold at least ``eval.knn_k`` samples (the bank) and at least 2 classes.
Labels are read from the sample table (memory-mapped: a column of int64, no image is read).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_pipeline.contract import sample_table
from trainer.evaluation.bank_subset import bank_subset_ids


def _labels(shard_dir: Path, field: str, bank_samples: int | None = None, subset_seed: int = 0) -> np.ndarray:
    try:
        table = sample_table(shard_dir)
    except FileNotFoundError as error:
        raise ValueError(f"{field}={shard_dir}: {error}") from None
    ids = (np.arange(table.num_samples) if bank_samples is None
           else bank_subset_ids(table.num_samples, bank_samples, subset_seed))
    return table.labels(ids)


def _check(labels: np.ndarray, field: str, shard_dir: Path, least: int, fix: str) -> None:
    unlabelled = int((labels < 0).sum())
    if unlabelled:
        raise ValueError(f"{field}={shard_dir}: {unlabelled} of its {len(labels)} samples have no label, and kNN and "
                         f"the linear probe score labels: {fix}")
    if len(labels) < least:
        raise ValueError(f"{field}={shard_dir} holds {len(labels)} samples, fewer than eval.knn_k={least}: lower "
                         "eval.knn_k or use a larger labelled set")
    if len(np.unique(labels)) < 2:
        raise ValueError(f"{field}={shard_dir} has a single class: accuracy over one class means nothing; use a "
                         "labelled set with several classes")


def check_evaluation_data(config) -> None:
    """Raise ``ValueError`` naming the field and the fix when ``config``'s evaluation could not score;
    nothing to check when ``data.eval_shards`` is unset (evaluation is off)."""
    data, section = config.data, config.eval
    if data.eval_shards is None:
        return
    make = "make-shards with --labels (class folders, a label column)"
    _check(_labels(data.eval_shards, "data.eval_shards"), "data.eval_shards", data.eval_shards, 1,
           f"point data.eval_shards at a labelled held-out set ({make})")
    bank_dir = data.knn_bank_shards or data.train_shards
    bank_field = "data.knn_bank_shards" if data.knn_bank_shards else "data.train_shards (the kNN bank)"
    fix = ("point data.knn_bank_shards at labelled shards" if data.knn_bank_shards
           else "the training shards are the bank by default: set data.knn_bank_shards to a labelled set")
    _check(_labels(bank_dir, bank_field, section.bank_samples, section.bank_subset_seed), bank_field, bank_dir,
           section.knn_k, f"{fix} ({make})")


def evaluation_off_line(config) -> str | None:
    """The start-up line of a run without ``data.eval_shards``: evaluation is off, and the ``eval.*``
    settings that would act are named (None when evaluation is on)."""
    if config.data.eval_shards is not None:
        return None
    section = config.eval
    acting = [name for name, on in (("eval.knn_at_end", section.knn_at_end),
                                     (f"eval.every_epochs={section.every_epochs}", section.every_epochs > 0),
                                     ("eval.linear_at_end", section.linear_at_end)) if on]
    unused = f": {', '.join(acting)} therefore do nothing" if acting else ""
    return f"evaluation is off (data.eval_shards is unset){unused}; set data.eval_shards to a labelled held-out set"
