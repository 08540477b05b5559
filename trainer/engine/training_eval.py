"""Evaluations during a training run: kNN accuracy (and, at the end, the linear probe) of the
network as trained so far, next to the same architecture at its random initialisation."""

from __future__ import annotations

import copy
from typing import Callable

from trainer.checkpoint.engine_state import plain_model_from_engine
from trainer.evaluation.scoring import FrozenFeatureScores
from trainer.models import build_model


class TrainingEvaluation:
    """``initial_model``: the network before training (copied: it is the baseline to beat), at random
    init or, ``baseline="init_from"``, the weights ``model.init_from`` loaded (the results keep the
    ``*_random_init`` names; the log's ``baseline`` says which it was)."""

    def __init__(self, config, dims, initial_model, log, metrics, say: Callable[[str], None],
                 baseline: str = "random_init") -> None:
        self.config, self.dims, self.log, self.metrics, self.say = config, dims, log, metrics, say
        self.baseline = baseline
        self.scores = FrozenFeatureScores(config, dims, copy.deepcopy(initial_model))

    def run(self, engine, epoch: int, step: int, final: bool, network_statistics: dict | None = None) -> dict:
        """Collective: score the engine's network (with ``network_statistics`` in place of its
        BatchNorm statistics: the network ``model.pt`` holds), log and export the results, print
        them on rank 0 (on stdout when ``final``: the run's result, not only a log line)."""
        trained = plain_model_from_engine(engine, build_model(self.config.model), network_statistics)
        results = self.scores.score(trained, linear=final and self.config.eval.linear_at_end)
        engine.train()
        self.log.write(event="eval", epoch=epoch, step=step, final=final, baseline=self.baseline, **results)
        for network in ("trained", "random_init"):
            self.metrics.eval_knn.labels(self.metrics.rank, network).set(results[f"knn_{network}"])
        if self.dims.rank == 0:
            message = self._message(results, epoch)
            if final:
                print(message)
            else:
                self.say(message)
        return results

    def _message(self, results: dict, epoch: int) -> str:
        start = "random init" if self.baseline == "random_init" else "start (model.init_from)"
        linear = (f"; linear probe trained {100 * results['linear_trained']:.2f}%  {start} "
                  f"{100 * results['linear_random_init']:.2f}%" if "linear_trained" in results else "")
        return (f"kNN accuracy (k={self.config.eval.knn_k}, cosine, held-out split) after epoch {epoch}: trained "
                f"{100 * results['knn_trained']:.2f}%  {start} {100 * results['knn_random_init']:.2f}%"
                f"{linear} ({results['seconds']:.1f} s)")
