"""The kNN bank against the data a checkpoint was trained on, compared by what the shards hold (the
digest of their ``manifest.json``, recorded in the checkpoint's ``run.json``), not by where they are.

Only the training shards are compared, and only where an evaluation uses them: as the bank (kNN's
memory and the linear probe's training set) when ``data.knn_bank_shards`` is unset.  The same shard
set under another mount path passes; another shard set at the recorded path is refused, because
the bank would silently no longer be the training data.  ``data.knn_bank_shards`` banks on another
labelled set on purpose, and ``data.eval_shards`` may be any held-out set: neither is compared.
"""

from __future__ import annotations

from pathlib import Path

from data_pipeline.contract import MANIFEST_NAME, has_manifest, manifest_sha256
from trainer.provenance import read_provenance


def check_bank_is_training_data(config, checkpoint: Path) -> None:
    """Raise (naming the field, both digests and the fix) when ``config``'s bank is its training
    shards and those are not the shard set ``checkpoint``'s ``run.json`` recorded.  Nothing to check
    with ``data.knn_bank_shards`` set, or for a checkpoint without a recorded digest."""
    if config.data.knn_bank_shards is not None:
        return
    trained_on = (read_provenance(checkpoint) or {}).get("train_manifest") or {}
    recorded = trained_on.get("digest")
    if not recorded:
        return
    shards = config.data.train_shards
    other_bank = "or --set data.knn_bank_shards=PATH to bank on another labelled shard set"
    if not has_manifest(shards):
        raise FileNotFoundError(f"data.train_shards={shards} (the kNN bank, as data.knn_bank_shards is unset) has no "
                                f"{MANIFEST_NAME} here: pass --set data.train_shards=PATH where this machine holds the "
                                f"run's training shards (manifest {recorded}), {other_bank}")
    found = manifest_sha256(shards)
    if found != recorded:
        raise ValueError(f"data.train_shards={shards} holds other shards than checkpoint {checkpoint} was trained on "
                         f"(manifest {found} here, {recorded} in its run.json), and it is the kNN bank as "
                         f"data.knn_bank_shards is unset: point data.train_shards at the run's training shards, "
                         f"{other_bank}")
