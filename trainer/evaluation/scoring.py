"""Frozen-feature scores of the network being trained, next to the same network at its random init.

The random-init network never changes, so its kNN score is computed once per run and reused by
every evaluation during training and at its end.  Its features are not kept (a bank shard is N/T
rows on the device for the whole run); its weights are, for the linear probe at the end.  One
network's features are extracted, scored and released before the other's: a rank holds one bank
shard at a time.
"""

from __future__ import annotations

import time

from trainer.evaluation.features import EvaluationData, LocalFeatures, features_digest
from trainer.evaluation.knn import sharded_knn_accuracy
from trainer.evaluation.linear_protocol import linear_scores, probe_inputs
from trainer.evaluation.phase_agreement import EvaluationPhases
from trainer.evaluation.sharded_knn import knn_bank_shard
from trainer.models.backbone import InstanceModel
from trainer.parallel import ParallelDims


class FrozenFeatureScores:
    """Collective: every rank calls ``score`` together (features are extracted data-parallel, and
    each rank keeps only its own rows of the bank)."""

    def __init__(self, config, dims: ParallelDims, random_init: InstanceModel) -> None:
        self.config, self.dims = config, dims
        self._random_init = random_init
        self._random_knn = None
        self._data = None  # EvaluationData, built at the first score (not at all in runs that never evaluate)

    def _features(self, model: InstanceModel) -> tuple[LocalFeatures, LocalFeatures]:
        if self._data is None:
            self._data = EvaluationData(self.config.data, self.config.eval, self.dims)
        return self._data.bank_and_queries(model.to(self.dims.device))

    def _knn(self, bank: LocalFeatures, queries: LocalFeatures) -> tuple[int, float, str]:
        group = self.dims.data_parallel_group
        shard = knn_bank_shard(bank.features, bank.labels, bank.ids, group)
        knn = sharded_knn_accuracy(shard, queries.features, queries.labels, self.config.eval.knn_k,
                                   self.config.eval.knn_temperature, group)
        return shard.total_rows, knn, features_digest(queries, group)

    def _scores(self, model: InstanceModel, linear: bool, curve: bool,
                phases: EvaluationPhases) -> tuple[float, str, dict | None]:
        """(kNN accuracy, the held-out features' digest, the linear probe's scores when ``linear``),
        from one pass over the bank and the held-out set, in phases every rank agrees on
        (``phase_agreement``): the features (on each rank alone), the kNN, the probe's inputs (gathered
        to rank 0 for "sklearn") and the probe."""
        bank, queries = phases.run("features", lambda: self._features(model))
        bank_rows, knn, digest = phases.run("knn", lambda: self._knn(bank, queries))
        if not linear:
            return knn, digest, None
        settings = self.config.eval.linear
        gathered = phases.run("gather", lambda: probe_inputs(bank, queries, bank_rows, settings, self.dims))
        probe = phases.run("linear", lambda: linear_scores(bank, queries, bank_rows, settings, self.dims, curve,
                                                           gathered))
        return knn, digest, probe

    def score(self, trained: InstanceModel, linear: bool = False, fail_point: str | None = None) -> dict:
        """``{"knn_trained", "knn_random_init", "query_features_digest", "seconds"}`` (the digest: the
        trained network's held-out features, ``features_digest``, what `instcls eval` prints), plus
        with ``linear`` the probe of both networks (``linear_trained``, ``linear_random_init``,
        ``linear_method``; "sgd" adds ``linear_top5_*`` and ``linear_choice``, the sweep's pick) and
        the trained one's learning curve (``linear_curve``: label fraction -> accuracy), by
        ``eval.linear.method`` (``linear_protocol``).  Every rank returns its results, or every rank
        raises (``phase_agreement``).  ``fail_point``: armed, the first network's evaluation fails
        after its features are gathered (for the probe, else for the kNN)."""
        started = time.perf_counter()
        results: dict = {}
        group = self.dims.control_group if self.dims.is_distributed else None
        phases = EvaluationPhases(group, fail_point, fail_at="gather" if linear else "knn")
        if self._random_knn is None or linear:
            self._random_knn, _, random_probe = self._scores(self._random_init, linear, curve=False, phases=phases)
            if random_probe is not None:
                results.update(_probe_fields(random_probe, "random_init"))
        knn_trained, digest, trained_probe = self._scores(trained, linear, curve=True, phases=phases)
        results.update(knn_trained=knn_trained, knn_random_init=self._random_knn, query_features_digest=digest)
        if trained_probe is not None:
            results.update(_probe_fields(trained_probe, "trained"))
            results["linear_curve"] = trained_probe["curve"]
            results["linear_method"] = trained_probe["method"]
            if "choice" in trained_probe:
                results["linear_choice"] = trained_probe["choice"]
        results["seconds"] = round(time.perf_counter() - started, 3)
        return results


def _probe_fields(probe: dict, network: str) -> dict:
    fields = {f"linear_{network}": probe["top1"]}
    if probe.get("top5") is not None:
        fields[f"linear_top5_{network}"] = probe["top5"]
    return fields
