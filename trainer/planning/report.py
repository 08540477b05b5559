"""What `instcls plan` prints and writes: per planned objective, the breakdown, its total, whether it
fits, the largest N that does, and the ZeRO stage to run.

The flag-driven plan (`--num-classes N`, no ``objective``) compares the three ways to train the N-way
classifier: DDP, DHP and PIC.  A config's plan is its own objective's, as its ``memory_plan``
describes it (SwAV's prototypes and queue, not N rows).
"""

from __future__ import annotations

from dataclasses import replace

from trainer.objectives.memory_plan import ClassifierRows, Prototypes, SampledRows
from trainer.planning.largest_n import largest_classes
from trainer.planning.plan_input import FLAG_MODES, GIB, UNBOUNDED_CLASSES, PlanInput
from trainer.planning.prediction import predict
from trainer.planning.zero_stages import recommend_stage


def planned_variants(plan: PlanInput) -> list[PlanInput]:
    """The objective the job describes, or, without one, the flag-driven plan in each mode."""
    if plan.objective is not None:
        return [plan]
    return [replace(plan, mode=mode, update_in_backward=plan.update_in_backward and mode == "dhp")
            for mode in FLAG_MODES]


def plan_modes(plan: PlanInput, capacity_bytes: int) -> dict[str, dict]:
    """What ``format_plan`` prints, per planned objective (``mode``: ddp, dhp, pic, swav, ...): the
    breakdown in bytes, its total, whether it fits ``capacity_bytes``, the largest N that does (None:
    any N), every ZeRO stage's total and the stage recommended.  `instcls plan --json` writes it."""
    modes = {}
    for variant in planned_variants(plan):
        breakdown = predict(variant)
        need = sum(breakdown.values())
        largest = largest_classes(variant, capacity_bytes)
        modes[variant.mode] = dict(breakdown=breakdown, total_bytes=need, fits=need <= capacity_bytes,
                                   largest_classes=None if largest >= UNBOUNDED_CLASSES // 2 else largest,
                                   **recommend_stage(variant, capacity_bytes).as_json())
    return modes


def objective_label(plan: PlanInput) -> str:
    description = plan.objective_plan
    if isinstance(description, SampledRows):
        return f"PIC (K={description.queue_size:,} recent ids, rows on {description.row_store})"
    if isinstance(description, Prototypes):
        queue = f"queue {description.queue_length:,}" if description.queue_length else "no queue"
        return f"SwAV (K={description.num_prototypes:,} prototypes, {queue})"
    if isinstance(description, ClassifierRows):
        return description.kind.upper()
    return plan.mode


def _job_line(plan: PlanInput) -> str:
    if plan.backbone is None:
        return "    (no backbone planned)"
    checkpointing = "on" if plan.activation_checkpointing else "off"
    counts: dict[int, int] = {}
    for side in plan.sides:
        counts[side] = counts.get(side, 0) + 1
    views = " + ".join(f"{count} x {side}" for side, count in counts.items())
    return (f"    backbone {plan.backbone} on {views} px views, optimizer {plan.optimizer}, ZeRO-{plan.zero_stage}, "
            f"activation checkpointing {checkpointing}")


def format_plan(plan: PlanInput, capacity_bytes: int) -> str:
    lines = []
    for variant, planned in zip(planned_variants(plan), plan_modes(plan, capacity_bytes).values()):
        verdict = "fits" if planned["fits"] else "does NOT fit"
        instances = f"N={plan.num_classes:,}, " if plan.num_classes else ""  # 0: the objective does not need N
        lines.append(f"{objective_label(variant)}: {instances}T={plan.ranks}, batch {plan.batch}, "
                     f"D={plan.dim}, {plan.dtype}: {planned['total_bytes'] / GIB:.2f} GiB per rank -> {verdict} in "
                     f"{capacity_bytes / GIB:g} GiB")
        lines.append(_job_line(variant))
        for name, value in planned["breakdown"].items():
            lines.append(f"    {name:<50}{value / GIB:>10.3f} GiB")
        largest = planned["largest_classes"]
        lines.append("    largest N that fits: " + ("any (device memory does not grow with N)"
                                                     if largest is None else f"{largest:,}"))
        stages = ", ".join(f"{stage}: {figures['total_bytes'] / GIB:.2f}"
                           for stage, figures in planned["zero_stages"].items())
        lines.append(f"    per ZeRO stage (GiB) {stages} -> {planned['recommendation']}")
    return "\n".join(lines)
