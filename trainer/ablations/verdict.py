"""Mean ± std over seeds, and whether each published direction reproduced.

A difference counts only when it is larger than the seeds' noise: the standard error of the
difference of two means, sqrt(s_a^2 / n_a + s_b^2 / n_b).  With one seed per variant there is no
noise estimate and the sign alone decides, which the outcome says.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from trainer.ablations.catalogue import Ablation, Claim
from trainer.ablations.runner import RunResult

REPRODUCES = "reproduces"
WITHIN_NOISE = "within seed noise"
REVERSED = "does not reproduce"
NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class Stats:
    """kNN accuracy in percentage points over seeds."""

    mean: float
    std: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.2f} ± {self.std:.2f}" if self.n > 1 else f"{self.mean:.2f}"


def summarise(values: list[float]) -> Stats:
    points = [100 * value for value in values]
    return Stats(statistics.fmean(points), statistics.stdev(points) if len(points) > 1 else 0.0, len(points))


def accuracy(results: list[RunResult], ablation: Ablation, label: str, epoch: int | None = None) -> Stats | None:
    """The variant's kNN at ``epoch`` (None: the end), over its seeds; None if no run reached it."""
    runs = [r for r in results if r.ablation == ablation.name and r.variant == label]
    values = [r.knn_final if epoch is None else r.knn_by_epoch.get(epoch) for r in runs]
    values = [value for value in values if value is not None]
    return summarise(values) if values else None


@dataclass(frozen=True)
class Verdict:
    claim: Claim
    difference: float | None  # points, in the claimed direction (positive: as the paper found)
    noise: float | None
    outcome: str

    def describe(self) -> str:
        if self.difference is None:
            return f"{self.claim.describe()}: {self.outcome}"
        noise = f" (seed noise ±{self.noise:.2f})" if self.noise else " (one seed: no noise estimate)"
        return f"{self.claim.describe()}: {self.difference:+.2f} points{noise}: {self.outcome}"


def _difference(better: Stats, worse: Stats) -> tuple[float, float]:
    noise = math.sqrt(better.std**2 / better.n + worse.std**2 / worse.n)
    return better.mean - worse.mean, noise


def judge(claim: Claim, ablation: Ablation, results: list[RunResult]) -> Verdict:
    if claim.kind == "gap_shrinks":
        early = [accuracy(results, ablation, label, claim.epoch) for label in (claim.better, claim.worse)]
        end = [accuracy(results, ablation, label) for label in (claim.better, claim.worse)]
        if None in early or None in end:
            return Verdict(claim, None, None, NOT_MEASURED)
        early_gap, early_noise = _difference(*early)
        end_gap, end_noise = _difference(*end)
        shrink, noise = early_gap - end_gap, math.hypot(early_noise, end_noise)
        return Verdict(claim, shrink, noise, REPRODUCES if shrink > noise else
                       WITHIN_NOISE if shrink > -noise else REVERSED)
    better = accuracy(results, ablation, claim.better, claim.epoch)
    worse = accuracy(results, ablation, claim.worse, claim.epoch)
    if better is None or worse is None:
        return Verdict(claim, None, None, NOT_MEASURED)
    difference, noise = _difference(better, worse)
    if claim.kind == "at_least":
        return Verdict(claim, difference, noise, REPRODUCES if difference >= -noise else REVERSED)
    return Verdict(claim, difference, noise, REPRODUCES if difference > noise else
                   WITHIN_NOISE if difference > -noise else REVERSED)
