"""Memory of MoCo's key queue per rank (``QueuedKeys``, ``trainer.objectives.moco``).

The queue's share of the K slots (the largest over the ranks), each an fp32 key and an int64 sample
id, with no gradient and no optimizer state.  A step all-gathers every rank's query and key (fp32,
with the queries' gradient in the backward) and scores the queries, and with CO2 the keys too,
against the queue's share through the chunked kernel's workspace (or the fused kernels' buffers),
with one positive logit per scored column.
"""

from __future__ import annotations

from trainer.objectives.memory_plan import QueuedKeys
from trainer.planning.classifier_memory import chunk_workspace, co2_scratch, fused_workspace
from trainer.planning.plan_input import PlanInput


def queue_share(plan: PlanInput, queue: QueuedKeys) -> int:
    """Slots the rank holding the most of them keeps."""
    return -(-queue.queue_size // plan.ranks)


def queued_keys_breakdown(plan: PlanInput, queue: QueuedKeys) -> dict[str, int]:
    slots = queue_share(plan, queue)
    scored = plan.batch * (2 if queue.co2 else 1)  # the group's queries, and its keys with CO2
    chunk = min(queue.chunk_size, slots)
    fused = plan.runs_fused(queue.kernel, queue.co2)
    return {
        "queue keys (its share x D, fp32)": slots * plan.dim * 4,
        "queue sample ids": slots * 8,
        "gathered queries and keys (and the queries' gradient)": plan.batch * plan.dim * 4 * 3 + scored * 4,
        "logits/activations (chunk workspace)": 0 if fused else chunk_workspace(plan, scored, chunk),
        "fused kernel buffers": fused_workspace(plan, scored, slots, False, queue.chunk_size, 1) if fused else 0,
        "CO2 term (chunk scratch)": co2_scratch(plan, queue.co2, scored, chunk),
    }


def queued_keys_checkpoint_bytes(plan: PlanInput, queue: QueuedKeys) -> int:
    """What a save stages: the rank's keys and ids."""
    return queue_share(plan, queue) * (plan.dim * 4 + 8)
