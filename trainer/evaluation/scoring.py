"""Frozen-feature scores of the network being trained, next to the same network at its random init.

The random-init network never changes, so its kNN score is computed once per run and reused by
every evaluation during training and at its end.  Its features are not kept (a bank shard is N/T
rows on the device for the whole run); its weights are, for the linear probe at the end.
"""

from __future__ import annotations

import time

from trainer.evaluation.features import EvaluationData, features_digest, gather_to_rank0_host
from trainer.evaluation.knn import sharded_knn_accuracy
from trainer.evaluation.linear import linear_probe_accuracy, linear_probe_curve
from trainer.evaluation.sharded_knn import knn_bank_shard
from trainer.models.backbone import InstanceModel
from trainer.parallel import ParallelDims
from trainer.parallel.rank0_work import run_on_rank0


class FrozenFeatureScores:
    """Collective: every rank calls ``score`` together (features are extracted data-parallel, and
    each rank keeps only its own rows of the kNN bank)."""

    def __init__(self, config, dims: ParallelDims, random_init: InstanceModel) -> None:
        self.config, self.dims = config, dims
        self._random_init = random_init
        self._random_knn = None
        self._data = None  # EvaluationData, built at the first score (not at all in runs that never evaluate)

    def _scores(self, model: InstanceModel, linear: bool) -> tuple[float, str, tuple | None]:
        """(kNN accuracy, the held-out features' digest, the linear probe's inputs gathered to host
        memory when ``linear``), from one pass over the bank and the held-out set."""
        if self._data is None:
            self._data = EvaluationData(self.config.data, self.config.eval, self.dims)
        bank, queries = self._data.bank_and_queries(model.to(self.dims.device))
        shard = knn_bank_shard(bank.features, bank.labels, bank.ids, self.dims.data_parallel_group)
        knn = sharded_knn_accuracy(shard, queries.features, queries.labels, self.config.eval.knn_k,
                                   self.config.eval.knn_temperature, self.dims.data_parallel_group)
        probe_inputs = None
        if linear:  # the probe runs on rank 0, the only rank that gathers the features
            everything = gather_to_rank0_host(bank, self.dims), gather_to_rank0_host(queries, self.dims)
            if self.dims.rank == 0:
                probe_inputs = tuple(t for rows in everything for t in (rows.features, rows.labels))
        return knn, features_digest(queries, self.dims.data_parallel_group), probe_inputs

    def score(self, trained: InstanceModel, linear: bool = False) -> dict:
        """``{"knn_trained", "knn_random_init", "query_features_digest", "seconds"}`` (the digest: the
        trained network's held-out features, ``features_digest``, what `instcls eval` prints), plus
        with ``linear`` the probe of both networks and the trained one's learning curve
        (``linear_curve``: label fraction -> accuracy).
        The probe fits on rank 0, on the bank gathered into its host memory (``eval.bank_samples``
        bounds it), for as long as it takes: the other ranks wait without a collective deadline
        (``run_on_rank0``); every rank returns its results."""
        started = time.perf_counter()
        random_probe_inputs = None
        if self._random_knn is None or linear:
            self._random_knn, _, random_probe_inputs = self._scores(self._random_init, linear)
        knn_trained, digest, trained_probe_inputs = self._scores(trained, linear)
        results = {"knn_trained": knn_trained, "knn_random_init": self._random_knn, "query_features_digest": digest}
        if linear:
            def probe() -> dict:  # on rank 0, the one holding the gathered features
                curve = {str(f): a for f, a in linear_probe_curve(*trained_probe_inputs).items()}
                return {"linear_curve": curve, "linear_trained": curve["1.0"],  # the all-labels point is the probe
                        "linear_random_init": linear_probe_accuracy(*random_probe_inputs)}

            results.update(run_on_rank0(probe, self.dims.control_group))
        results["seconds"] = round(time.perf_counter() - started, 3)
        return results
