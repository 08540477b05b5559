"""`instcls eval`: one protocol's accuracy of a frozen backbone, trained or at its random init."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.initial_weights import starting_network
from trainer.evaluation.features import EvaluationData, features_digest, gather_to_rank0_host, save_features
from trainer.evaluation.knn import sharded_knn_accuracy
from trainer.evaluation.linear_protocol import linear_scores
from trainer.evaluation.sharded_knn import knn_bank_shard
from trainer.parallel import init_distributed
from trainer.parallel.collectives import all_reduce_
from trainer.parallel.rank0_work import run_on_rank0

PROTOCOLS = ("knn", "linear")


def require_eval_shards(config, source: Path | str) -> None:
    """``source``: where ``config`` came from (the config file, or the checkpoint's run.json)."""
    if config.data.eval_shards is None:
        raise ValueError(f"{source}: data.eval_shards is not set; point it at a labelled held-out shard set "
                         "(--set data.eval_shards=PATH)")


def random_init_model(config):
    """The network the trainer starts from with the config's seed (and ``model.init_from``, when
    set): the baseline a trained one must beat."""
    return starting_network(config)


@dataclass(frozen=True)
class FrozenAccuracy:
    """One protocol's result on this rank: ``accuracy`` in [0, 1], the same on every rank."""

    label: str  # the protocol's name for people
    accuracy: float
    query_features_digest: str  # ``features_digest`` of the held-out features (the trainer logs the same)
    rank: int
    details: dict | None = None  # the linear probe's: top-5, the sweep's choice, the label-fraction curve


def frozen_accuracy(model, config, protocol: str, features_out: Path | None = None) -> FrozenAccuracy:
    """All ranks together: ``protocol``'s accuracy of ``model``'s frozen features; with
    ``features_out``, the bank's and the queries' features are also written there (rank 0)."""
    dims = init_distributed(device=config.parallel.device, timeout_s=config.parallel.collective_timeout_s)
    model.to(dims.device)
    if protocol not in PROTOCOLS:
        raise ValueError(f"eval protocol {protocol!r} is unknown: choose one of {', '.join(PROTOCOLS)}")
    bank, queries = EvaluationData(config.data, config.eval, dims).bank_and_queries(model)
    group = dims.data_parallel_group
    digest = features_digest(queries, group)
    if features_out is not None:  # every row in one process: rank 0's (held-out sets and bank subsets)
        bank_all, queries_all = gather_to_rank0_host(bank, dims), gather_to_rank0_host(queries, dims)
        # the others wait for rank 0's write without a collective deadline
        run_on_rank0(lambda: save_features(features_out, bank_all, queries_all), dims.control_group)
    if protocol == "knn":
        shard = knn_bank_shard(bank.features, bank.labels, bank.ids, group)
        accuracy = sharded_knn_accuracy(shard, queries.features, queries.labels, config.eval.knn_k,
                                        config.eval.knn_temperature, group)
        return FrozenAccuracy(f"kNN (k={config.eval.knn_k}, cosine)", accuracy, digest, dims.rank)
    # the trainer's end-of-run probe: the same method, settings and features give the same figure
    bank_rows = int(all_reduce_(torch.tensor([bank.ids.numel()], device=bank.ids.device), dist.ReduceOp.SUM,
                                group).item())
    probe = linear_scores(bank, queries, bank_rows, config.eval.linear, dims, curve=False)
    return FrozenAccuracy(f"linear probe ({probe['method']})", probe["top1"], digest, dims.rank, probe)
