"""Evaluations during a training run: kNN accuracy (and, at the end, the linear probe) of the
network as trained so far, next to the same architecture at its random initialisation.

Their inputs are checked when the run starts (``check_evaluation_data``: labels, sizes, classes), so a
run that could not be scored stops before its first step.  The end-of-run evaluation comes after the
final checkpoint is complete: an error in it is logged, recorded and exported
(``instcls_eval_failed``), and the run still finishes (`instcls eval` re-scores the checkpoint).
"""

from __future__ import annotations

import copy
from typing import Callable

from trainer.checkpoint.engine_state import plain_model_from_engine
from trainer.evaluation.eval_data_check import check_evaluation_data, evaluation_off_line
from trainer.evaluation.scoring import FrozenFeatureScores
from trainer.failpoints import armed
from trainer.models import build_model
from trainer.parallel.rank0_work import run_on_rank0


def _problem_of(check: Callable[[object], None], config) -> str | None:
    """``check(config)``'s ``ValueError`` as its message (what rank 0 hands every rank), else None."""
    try:
        check(config)
    except ValueError as error:
        return str(error)
    return None


class TrainingEvaluation:
    """``initial_model``: the network before training (copied: it is the baseline to beat), at random
    init or, ``baseline="init_from"``, the weights ``model.init_from`` loaded (the results keep the
    ``*_random_init`` names; the log's ``baseline`` says which it was)."""

    def __init__(self, config, dims, initial_model, log, metrics, say: Callable[[str], None],
                 baseline: str = "random_init") -> None:
        self.config, self.dims, self.log, self.metrics, self.say = config, dims, log, metrics, say
        self.baseline = baseline
        self.scores = FrozenFeatureScores(config, dims, copy.deepcopy(initial_model))

    @classmethod
    def of_job(cls, config, dims, initial_model, log, metrics, say: Callable[[str], None],
               baseline: str) -> TrainingEvaluation | None:
        """The job's evaluation, its data checked now when the run will score it (rank 0 reads the labels;
        every rank raises the same ``ValueError``), or None when ``data.eval_shards`` is unset (said in
        one line)."""
        off = evaluation_off_line(config)
        if off is not None:
            say(off)
            return None
        section = config.eval
        if section.knn_at_end or section.linear_at_end or section.every_epochs:  # it will score: check it now
            problem = run_on_rank0(lambda: _problem_of(check_evaluation_data, config),
                                   dims.control_group if dims.is_distributed else None)
            if problem is not None:
                raise ValueError(problem)
        return cls(config, dims, initial_model, log, metrics, say, baseline)

    @property
    def at_end(self) -> bool:
        """Whether the run is scored when it finishes: kNN, the linear probe, or both."""
        return self.config.eval.knn_at_end or self.config.eval.linear_at_end

    def final(self, evaluate: Callable[[], dict]) -> dict:
        """``evaluate()``'s scores, or, if it raises, ``{"eval_failed": cause}``: logged and exported,
        never raised, since the final checkpoint is complete and the run has finished."""
        try:
            if armed("eval.end_of_run"):  # the drills' failing evaluation
                raise RuntimeError("fail point eval.end_of_run: the end-of-run evaluation failed on purpose")
            scores = evaluate()
        except Exception as error:  # noqa: BLE001 - any failure here must not fail a finished run
            cause = f"{type(error).__name__}: {error}"
            self.metrics.eval_failed.set(1)
            self.log.write(event="eval_failed", cause=cause)
            self.say(f"the end-of-run evaluation failed ({cause}); the run and its final checkpoint are complete: "
                     "re-score it with `instcls eval knn|linear --checkpoint auto`")
            return {"eval_failed": cause}
        self.metrics.eval_failed.set(0)
        return scores

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
        linear = (f"; linear probe ({results['linear_method']}) trained {100 * results['linear_trained']:.2f}%  "
                  f"{start} {100 * results['linear_random_init']:.2f}%" if "linear_trained" in results else "")
        if "linear_choice" in results:  # the sweep's pick, by its top-1 on the held-out part of the bank
            choice = results["linear_choice"]
            linear += f" (lr {choice['learning_rate']:g}, weight decay {choice['weight_decay']:g})"
        return (f"kNN accuracy (k={self.config.eval.knn_k}, cosine, held-out split) after epoch {epoch}: trained "
                f"{100 * results['knn_trained']:.2f}%  {start} {100 * results['knn_random_init']:.2f}%"
                f"{linear} ({results['seconds']:.1f} s)")
