"""Frozen-feature scores of the network being trained, next to the same network at its random init.

The random-init network never changes, so its features are extracted once per run and reused by
every evaluation during training and at its end.
"""

from __future__ import annotations

import time

from trainer.evaluation.features import bank_and_queries
from trainer.evaluation.knn import knn_accuracy
from trainer.evaluation.linear import linear_probe_accuracy, linear_probe_curve
from trainer.models.backbone import InstanceModel
from trainer.parallel import ParallelDims


class FrozenFeatureScores:
    """Collective: every rank calls ``score`` together (features are extracted data-parallel)."""

    def __init__(self, config, dims: ParallelDims, random_init: InstanceModel) -> None:
        self.config, self.dims = config, dims
        self._random_init = random_init
        self._random_features = None
        self._random_knn = None  # the random network's kNN score never changes either

    def _features(self, model: InstanceModel):
        return bank_and_queries(model.to(self.dims.device), self.config.data, self.dims)

    def _knn(self, features) -> float:
        return knn_accuracy(*features, self.config.eval.knn_k, self.config.eval.knn_temperature)

    def score(self, trained: InstanceModel, linear: bool = False) -> dict:
        """``{"knn_trained", "knn_random_init", "seconds"}``, plus with ``linear`` the probe of both
        networks and the trained one's learning curve (``linear_curve``: label fraction -> accuracy)."""
        started = time.perf_counter()
        if self._random_features is None:
            self._random_features = self._features(self._random_init)
            self._random_knn = self._knn(self._random_features)
            self._random_init = None  # the features are all that is needed from now on
        trained_features = self._features(trained)
        results = {"knn_trained": self._knn(trained_features), "knn_random_init": self._random_knn}
        if linear:
            results["linear_curve"] = {str(f): a for f, a in linear_probe_curve(*trained_features).items()}
            results["linear_trained"] = results["linear_curve"]["1.0"]  # the all-labels point is the probe
            results["linear_random_init"] = linear_probe_accuracy(*self._random_features)
        results["seconds"] = round(time.perf_counter() - started, 3)
        return results
