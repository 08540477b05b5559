"""Evaluations during a training run: kNN accuracy (and, at the end, the linear probe) of the
network as trained so far, next to the same architecture at its random initialisation.

Their inputs are checked when the run starts (``check_evaluation_data``: labels, sizes, classes), so a
run that could not be scored stops before its first step.  The end-of-run evaluation comes after the
final checkpoint is complete: an error in it is logged, recorded and exported
(``instcls_eval_failed``) on every rank, and the run still finishes (`instcls eval` re-scores the
checkpoint).  The final checkpoint records how it went (``run_end``), so a resume of it does not
evaluate again.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

from trainer.checkpoint.engine_state import plain_model_from_engine
from trainer.checkpoint.run_end import record_run_end
from trainer.evaluation.eval_data_check import check_evaluation_data, evaluation_off_line
from trainer.evaluation.scoring import FrozenFeatureScores
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
        never raised, since the final checkpoint is complete and the run has finished.  An error on one
        rank ends the evaluation on every rank at the next phase boundary (``phase_agreement``), so
        every rank logs it and ends."""
        try:
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

    def run(self, engine, one_network, state, final: bool, record) -> dict:
        """Collective: score the engine's network as trained so far (``state``: the trainer's
        position; its BatchNorm statistics those ``one_network`` agrees on, the network ``model.pt``
        holds) and its random init, plus, ``final`` with ``eval.linear_at_end``, the linear probe;
        log and export the results (``record.scored``: the TrainJob's status), print them on rank 0
        (on stdout when ``final``: the run's result, not only a log line)."""
        epoch, step = state.epoch, state.global_step
        one_network.agree(step, "eval")
        trained = plain_model_from_engine(engine, build_model(self.config.model), one_network.statistics())
        # eval.end_of_run: the drills' evaluation that fails on one rank after its features are gathered
        results = self.scores.score(trained, linear=final and self.config.eval.linear_at_end,
                                    fail_point="eval.end_of_run" if final else None)
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
        record.scored(results)
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


def evaluate_finished_run(evaluation: TrainingEvaluation | None, evaluate: Callable[[], dict],
                          checkpoint: Path | None, rank: int, say: Callable[[str], None]) -> dict | None:
    """The end-of-run evaluation of a run that finished (``evaluation.final``, when it has one), its
    course recorded by rank 0 in the final ``checkpoint`` (``run_end``): "running" before it starts,
    then "done" or "failed"; "off" without one.  A resume of that checkpoint neither trains nor
    evaluates again.  A record that cannot be written is said, not raised: the run has finished."""
    def record(state: str, cause: str | None = None) -> None:
        if rank == 0 and checkpoint is not None:
            try:
                record_run_end(checkpoint, state, cause)
            except OSError as error:
                say(f"could not record the run's end in {checkpoint} ({error}): a resume of it may evaluate again")

    if evaluation is None or not evaluation.at_end:
        record("off")
        return None
    record("running")
    scores = evaluation.final(evaluate)
    record("failed" if "eval_failed" in scores else "done", scores.get("eval_failed"))
    return scores
