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

    def _features(self, model: InstanceModel):
        return bank_and_queries(model.to(self.dims.device), self.config.data, self.dims)

    def score(self, trained: InstanceModel, linear: bool = False) -> dict:
        """``{"knn_trained", "knn_random_init", "seconds"}``, plus with ``linear`` the probe of both
        networks and the trained one's learning curve (``linear_curve``: label fraction -> accuracy)."""
        started = time.perf_counter()
        ev = self.config.eval
        if self._random_features is None:
            self._random_features = self._features(self._random_init)
            self._random_init = None  # the features are all that is needed from now on
        trained_features = self._features(trained)
        results = {
            "knn_trained": knn_accuracy(*trained_features, ev.knn_k, ev.knn_temperature),
            "knn_random_init": knn_accuracy(*self._random_features, ev.knn_k, ev.knn_temperature),
        }
        if linear:
            results["linear_trained"] = linear_probe_accuracy(*trained_features)
            results["linear_random_init"] = linear_probe_accuracy(*self._random_features)
            results["linear_curve"] = {str(f): a for f, a in linear_probe_curve(*trained_features).items()}
        results["seconds"] = round(time.perf_counter() - started, 3)
        return results

