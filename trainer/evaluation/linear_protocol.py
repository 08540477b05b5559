"""The linear probe of one network's frozen features, by ``eval.linear.method``: what the trainer's
end-of-run evaluation and `instcls eval linear` both run, so their figures are the same.

- "sgd" (``linear_sgd``): every rank keeps its own rows; the heads are trained data parallel on the
  job's devices, a collective under the normal timeout.
- "sklearn": scikit-learn on rank 0, on the bank gathered into its host memory; the other ranks wait
  without a collective deadline (``run_on_rank0``), since such a fit may outlast one.
"""

from __future__ import annotations

from trainer.evaluation.features import LocalFeatures, gather_to_rank0_host
from trainer.evaluation.linear import LABEL_FRACTIONS, linear_probe_accuracy, linear_probe_curve
from trainer.evaluation.linear_sgd import ProbeGrid, linear_probe
from trainer.parallel import ParallelDims
from trainer.parallel.rank0_work import run_on_rank0


def probe_grid(settings) -> ProbeGrid:
    """``eval.linear`` (a ``LinearProbeSection``) as the sweep ``linear_sgd`` trains."""
    return ProbeGrid(learning_rates=tuple(settings.learning_rates), weight_decays=tuple(settings.weight_decays),
                     epochs=settings.epochs, batch_size=settings.batch_size, momentum=settings.momentum,
                     held_out=settings.held_out, seed=settings.seed)


def probe_inputs(bank: LocalFeatures, queries: LocalFeatures, bank_rows: int, settings,
                 dims: ParallelDims) -> tuple[LocalFeatures | None, LocalFeatures | None] | None:
    """Collective: what the probe needs beyond each rank's own rows: for "sklearn", the bank and the
    queries gathered into rank 0's host memory (``(None, None)`` on the others); None for "sgd"."""
    if settings.method_for(bank_rows) != "sklearn":
        return None
    return gather_to_rank0_host(bank, dims), gather_to_rank0_host(queries, dims)


def linear_scores(bank: LocalFeatures, queries: LocalFeatures, bank_rows: int, settings, dims: ParallelDims,
                  curve: bool, gathered: tuple[LocalFeatures | None, LocalFeatures | None] | None = None) -> dict:
    """Collective: ``{"method", "top1"}`` of the probe on ``bank`` (``bank_rows`` over all ranks)
    scored on ``queries``; "sgd" adds ``top5`` (more than 5 classes) and ``choice`` (the sweep's
    pick and every head's held-out top-1); with ``curve``, ``curve`` maps each label fraction
    (``LABEL_FRACTIONS``, as strings) to its top-1.  The same on every rank.  ``gathered``: what
    ``probe_inputs`` returned, when the caller gathered it first (else it is gathered here)."""
    method = settings.method_for(bank_rows)
    if method == "sgd":
        fractions = LABEL_FRACTIONS if curve else (1.0,)
        results = linear_probe(bank, queries, probe_grid(settings), dims.data_parallel_group, fractions)
        whole = results[1.0]
        scores = {"method": "sgd", "top1": whole.top1, "top5": whole.top5,
                  "choice": {key: value for key, value in whole.record().items() if key not in ("top1", "top5")}}
        if curve:
            scores["curve"] = {str(fraction): result.top1 for fraction, result in results.items()}
        return scores
    bank_all, queries_all = gathered or probe_inputs(bank, queries, bank_rows, settings, dims)

    def fit() -> dict:  # on rank 0, the one holding the gathered features
        inputs = (bank_all.features, bank_all.labels, queries_all.features, queries_all.labels)
        if curve:
            points = {str(f): a for f, a in linear_probe_curve(*inputs, seed=settings.seed).items()}
            return {"method": "sklearn", "top1": points["1.0"], "curve": points}  # all labels: the probe
        return {"method": "sklearn", "top1": linear_probe_accuracy(*inputs)}

    return run_on_rank0(fit, dims.control_group if dims.is_distributed else None)
