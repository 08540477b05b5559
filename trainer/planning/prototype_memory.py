"""Memory of SwAV's state per rank (``Prototypes``, ``trainer.objectives.swav``).

The prototypes are a replicated ``K x D`` fp32 matrix outside ZeRO, with their gradient (averaged
over the ranks as DDP would) and the state of the optimizer that steps them, the backbone's (SwAV's
code: LARC over the whole model).  The queue keeps each rank's share of ``queue_length`` samples,
every global crop's normalised fp32 feature.  None of it grows with N.

A step holds, besides: every view's normalised fp32 features and its scores ``[b, K]``, each global
crop's codes; the log-softmax each swapped pair (a global crop's codes against every other view)
saves for the backward, and the scores' gradients there; and, one global crop at a time, Sinkhorn
over the local batch with the queue's share in front: the queue's scores, their concatenation and
three working copies in ``sinkhorn_dtype`` (``trainer.objectives.swav.sinkhorn``).  Sinkhorn's copies are
freed before the swapped prediction starts, so the step holds the larger of the two phases: Sinkhorn
counts only by what it needs beyond the swapped prediction (the dry run of the SwAV config measures
0.9x of this plan on fake devices, `tests/unit/test_dry_run.py`).
"""

from __future__ import annotations

from trainer.objectives.memory_plan import Prototypes
from trainer.planning.plan_input import PlanInput, element_size, optimizer_state_bytes

SINKHORN_WORKING_COPIES = 3  # log Q, its shifted copy and their exponential, alive at once


def queue_share(plan: PlanInput, prototypes: Prototypes) -> int:
    """Queued samples a rank keeps (``queue_length`` is a multiple of the ranks in a valid job)."""
    return -(-prototypes.queue_length // plan.ranks)


def prototypes_breakdown(plan: PlanInput, prototypes: Prototypes) -> dict[str, int]:
    k, dim, views, crops = prototypes.num_prototypes, plan.dim, plan.views, prototypes.global_views
    local = plan.batch // plan.ranks
    queued = queue_share(plan, prototypes)
    matrix = k * dim * 4
    swapped = (crops * (views - 1) + views) * local * k * 4
    sinkhorn = queued * k * 4 + (local + queued) * k * (4 + SINKHORN_WORKING_COPIES * element_size(
        prototypes.sinkhorn_dtype))
    return {
        "prototypes (K x D, on every rank)": matrix,
        "prototype gradients": matrix,
        f"prototype optimizer state ({plan.optimizer})": k * dim * optimizer_state_bytes(plan),
        "queue (its share x global crops x D)": queued * crops * dim * 4,
        "features, scores and codes (b x K per view)": views * local * (dim + k) * 4 + crops * local * k * 4,
        "swapped prediction (saved log-softmax, gradients)": swapped,
        "Sinkhorn beyond that ((b + queue share) x K)": max(0, sinkhorn - swapped),
    }


def prototypes_checkpoint_bytes(plan: PlanInput, prototypes: Prototypes) -> int:
    """What a save stages: the prototypes, their optimizer state and the rank's queue rows."""
    matrix = prototypes.num_prototypes * plan.dim
    return matrix * (4 + optimizer_state_bytes(plan)) + queue_share(plan, prototypes) * prototypes.global_views * \
        plan.dim * 4
