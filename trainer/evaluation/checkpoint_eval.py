"""`instcls eval`: one protocol's accuracy of a frozen backbone, trained or at its random init."""

from __future__ import annotations

from pathlib import Path

from trainer.engine.rng_state import reseed
from trainer.evaluation.features import EvaluationData, gather_to_host
from trainer.evaluation.knn import sharded_knn_accuracy
from trainer.evaluation.linear import linear_probe_accuracy
from trainer.evaluation.sharded_knn import knn_bank_shard
from trainer.models import build_model
from trainer.parallel import init_distributed

PROTOCOLS = ("knn", "linear")


def require_eval_shards(config, config_path: Path) -> None:
    if config.data.eval_shards is None:
        raise ValueError(f"{config_path}: data.eval_shards is not set; point it at a labelled held-out shard set")


def random_init_model(config):
    """The untrained network the trainer starts from with the config's seed: the baseline a
    trained one must beat."""
    reseed(config.seed, 0, 0)
    return build_model(config.model)


def frozen_accuracy(model, config, protocol: str) -> tuple[str, float, int]:
    """(the protocol's name for people, accuracy in [0, 1], this process's rank), all ranks together."""
    dims = init_distributed(device=config.parallel.device)
    model.to(dims.device)
    if protocol not in PROTOCOLS:
        raise ValueError(f"eval protocol {protocol!r} is unknown: choose one of {', '.join(PROTOCOLS)}")
    bank, queries = EvaluationData(config.data, config.eval, dims).bank_and_queries(model)
    group = dims.data_parallel_group
    if protocol == "knn":
        shard = knn_bank_shard(bank.features, bank.labels, bank.ids, group)
        accuracy = sharded_knn_accuracy(shard, queries.features, queries.labels, config.eval.knn_k,
                                        config.eval.knn_temperature, group)
        return f"kNN (k={config.eval.knn_k}, cosine)", accuracy, dims.rank
    # the probe needs the whole bank in one process: gathered to every rank's host memory
    bank_features, bank_labels = gather_to_host(bank, dims)
    query_features, query_labels = gather_to_host(queries, dims)
    return "linear probe", linear_probe_accuracy(bank_features, bank_labels, query_features, query_labels), dims.rank
