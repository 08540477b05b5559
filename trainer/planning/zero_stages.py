"""Which ZeRO stage a job needs: its plan at every stage, and the lowest that fits.

The stages trade memory for communication: ZeRO-1 partitions the optimizer state, ZeRO-2 the
gradients too (the same bytes on the wire as plain data parallel: a reduce-scatter and an
all-gather instead of an all-reduce), ZeRO-3 the weights as well (gathered again for every forward
and backward: half as much traffic again).  So the recommendation is the lowest stage whose plan
fits.  When none does, it says what would: activation checkpointing (each residual unit keeps its
input only), or more ranks for the same global batch (fewer images per rank, smaller shards).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainer.planning.plan_input import GIB, ZERO_STAGES, PlanInput
from trainer.planning.prediction import total


@dataclass(frozen=True)
class StageFit:
    """The lowest stage that fits (None: none) and every stage's total, for one variant of the job."""

    totals: dict[int, int]
    stage: int | None

    @classmethod
    def of(cls, plan: PlanInput, capacity_bytes: int) -> StageFit:
        # a momentum teacher is kept at ZeRO 0 to 2 only (trainer.engine.teacher_setup refuses stage 3)
        stages = [stage for stage in ZERO_STAGES if not (plan.teacher and stage == 3)]
        totals = {stage: total(replace(plan, zero_stage=stage)) for stage in stages}
        return cls(totals, next((stage for stage, need in totals.items() if need <= capacity_bytes), None))


@dataclass(frozen=True)
class StageRecommendation:
    """``stages``: the job as planned, at every stage; ``stage``: the lowest that fits (None: none).
    When none fits: ``with_checkpointing``, the same job with activation checkpointing (None when the
    job has it already, or there is no backbone); ``more_ranks``, the fewest ranks (doubling, the same
    global batch) at which a stage fits, and that fit (None: none up to one image per rank)."""

    capacity_bytes: int
    stages: StageFit
    with_checkpointing: StageFit | None = None
    more_ranks: tuple[int, StageFit] | None = None

    @property
    def stage(self) -> int | None:
        return self.stages.stage

    def text(self) -> str:
        capacity = f"{self.capacity_bytes / GIB:g} GiB"
        if self.stage is not None:
            return f"recommended: ZeRO-{self.stage} (the lowest stage that fits in {capacity})"
        advice = []
        if self.with_checkpointing is not None and self.with_checkpointing.stage is not None:
            stage = self.with_checkpointing.stage
            advice.append(f"with activation checkpointing ZeRO-{stage} fits "
                          f"({self.with_checkpointing.totals[stage] / GIB:.2f} GiB)")
        if self.more_ranks is not None:
            ranks, fit = self.more_ranks
            advice.append(f"on {ranks} ranks (the same global batch) ZeRO-{fit.stage} fits "
                          f"({fit.totals[fit.stage] / GIB:.2f} GiB)")
        if not advice:
            advice.append("nor with activation checkpointing or more ranks: plan a smaller batch or backbone")
        return f"no ZeRO stage fits in {capacity}; " + "; ".join(advice)

    def as_json(self) -> dict:
        return {"zero_stages": {str(stage): {"total_bytes": need, "fits": need <= self.capacity_bytes}
                                for stage, need in self.stages.totals.items()},
                "recommended_zero_stage": self.stage, "recommendation": self.text()}


def recommend_stage(plan: PlanInput, capacity_bytes: int) -> StageRecommendation:
    stages = StageFit.of(plan, capacity_bytes)
    if stages.stage is not None:
        return StageRecommendation(capacity_bytes, stages)
    with_checkpointing = None
    if plan.backbone is not None and not plan.activation_checkpointing:
        with_checkpointing = StageFit.of(replace(plan, activation_checkpointing=True), capacity_bytes)
    more_ranks = None
    ranks = plan.ranks * 2
    while ranks <= plan.batch and plan.batch % ranks == 0:
        fit = StageFit.of(replace(plan, ranks=ranks), capacity_bytes)
        if fit.stage is not None:
            more_ranks = (ranks, fit)
            break
        ranks *= 2
    return StageRecommendation(capacity_bytes, stages, with_checkpointing, more_ranks)
