"""Memory of the N-way cosine classifiers per rank: the full classifier (``ClassifierRows``: DHP or
DDP) and PIC's sampled rows (``SampledRows``).

First-principles: W, its gradient and SGD momentum for the rows a rank holds, the chunk workspace of
``ChunkWorkspace`` (logits and weight buffers) or the fused kernels' buffers, and the logits cache
(fp32 ``exp(z)`` of every scored sample and class) when its budget holds it.  On this machine it is
within 1-6% of the measured peaks of `bench ddp-vs-dhp` above a few MiB (a test holds it to 15%).
"""

from __future__ import annotations

from trainer.classifier.kernel.chunk_workspace import LogitsCache
from trainer.objectives.memory_plan import ClassifierRows, SampledRows
from trainer.planning.plan_input import PlanInput, element_size


def local_rows(plan: PlanInput, rows: ClassifierRows | SampledRows) -> int:
    """Rows a rank holds: all N replicated (DDP), else the largest shard of N over the ranks."""
    sharded = not isinstance(rows, ClassifierRows) or rows.sharded
    return -(-plan.num_classes // plan.ranks) if sharded else plan.num_classes


def co2_scratch(plan: PlanInput, co2: bool, scored: int, chunk: int) -> int:
    """CO2's term (``trainer.classifier.terms.co2``) reuses the kernel's chunk buffers.  Its fused
    backward (inductor, on every device) writes a chunk's ``dL/dz`` into one fresh ``[chunk, columns]``
    fp32 block, since inductor does not overwrite an input it reads across views."""
    return scored * chunk * 4 if co2 else 0


def fused_workspace(plan: PlanInput, scored: int, rows: int, row_buffer: bool, chunk_size: int, targets: int) -> int:
    """The fused path's buffers (``trainer.classifier.kernel.fused``): no logits anywhere.  Held through
    the backward: the scored rows' norms and the features' gradient.  Then, one after the other, the
    feature-gradient partials over ``FUSED_SPLITS`` programs per feature block (summed and freed), and
    the target passes: one column group of gathered target rows at a time, three fp32 ``[B, group, D]``
    temporaries beside the features' fp32 copy.  The larger of those two phases counts.  A chunk of
    rows' gradient is added where it cannot be written in place (in-backward SGD, sampled rows)."""
    from trainer.classifier.kernel.fused import FUSED_SPLITS_ON_FAKE_DEVICES, TARGET_COLUMNS_PER_PASS, padded_dim

    splits = FUSED_SPLITS_ON_FAKE_DEVICES
    softmax_partials = splits * scored * (4 + padded_dim(plan.dim) * 4)
    target_pass = 3 * scored * min(TARGET_COLUMNS_PER_PASS, targets) * plan.dim * 4 + scored * plan.dim * 4
    workspace = rows * 4 + scored * plan.dim * 4 + max(softmax_partials, target_pass)
    if row_buffer:
        workspace += (min(chunk_size, rows) + 1) * plan.dim * 4
    return workspace


def smoothing_state(plan: PlanInput, rows_plan: ClassifierRows, rows: int, scored: int) -> int:
    """Top-K smoothing (``trainer.classifier.hard_negatives``), on either path: the search's table (the K
    hardest negatives of each local row, int64), its inversion kept for the step's lookups when the
    rows are sharded (each entry held by its negative's owner: instance int64, slot int16, column
    int32; about ``rows * K`` entries on each rank), and each scored sample's K+1 target columns
    (int64) with their smoothing coefficients and gradients (fp32)."""
    top_k = rows_plan.hard_negatives
    if top_k <= 0:
        return 0
    inverted = (rows * top_k + 1) * (8 + 2 + 4) if rows_plan.sharded and plan.ranks > 1 else 0
    return rows * top_k * 8 + inverted + scored * (top_k + 1) * (8 + 4 + 4)


def chunk_workspace(plan: PlanInput, scored: int, chunk: int) -> int:
    workspace = scored * chunk * (4 + (element_size(plan.dtype) if plan.dtype != "float32" else 0))
    return workspace + 2 * chunk * plan.dim * 4 + chunk * 4 + scored * plan.dim * (4 + element_size(plan.dtype))


def sampled_rows_breakdown(plan: PlanInput, rows_plan: SampledRows) -> dict[str, int]:
    """PIC: a step scores the batch's ids plus K recent ids, about (K + batch) / T rows per rank
    (fewer when ids repeat; every local row with ``negatives: all``), fetched with their momentum; the
    leaf the kernel differentiates shares the fetched fp32 rows, so the gradient is the third copy.
    W and its momentum count on the device only for ``row_store: device``."""
    local = local_rows(plan, rows_plan)
    shard = local * plan.dim * 4
    sampled = local if rows_plan.all_negatives else min(-(-(rows_plan.queue_size + plan.batch) // plan.ranks), local)
    on_device = rows_plan.row_store == "device"
    scored = plan.batch * plan.views
    chunk = min(rows_plan.chunk_size, sampled)
    fused = plan.runs_fused(rows_plan.kernel, rows_plan.co2)
    return {
        "classifier weights": shard if on_device else 0,
        "classifier momentum": shard if on_device and plan.momentum else 0,
        "sampled rows (W, momentum, gradient)": 3 * sampled * plan.dim * 4,
        "logits/activations (chunk workspace)": 0 if fused else chunk_workspace(plan, scored, chunk),
        "fused kernel buffers": fused_workspace(plan, scored, sampled, True, rows_plan.chunk_size, 1) if fused else 0,
        "CO2 term (chunk scratch)": co2_scratch(plan, rows_plan.co2, scored, chunk),
    }


def classifier_rows_breakdown(plan: PlanInput, rows_plan: ClassifierRows) -> dict[str, int]:
    """The full classifier: W, its gradient (none with the update inside the backward) and momentum
    for the local rows; DHP scores the gathered batch against its shard, DDP its local batch
    against all N rows."""
    rows = local_rows(plan, rows_plan)
    scored = plan.batch * plan.views // plan.ranks * (plan.ranks if rows_plan.sharded else 1)
    chunk = min(rows_plan.chunk_size, rows)
    shard = rows * plan.dim * 4
    fused = plan.runs_fused(rows_plan.kernel, rows_plan.co2)
    cache = LogitsCache.size_bytes(scored, rows)
    cached = not fused and cache <= rows_plan.logits_cache_bytes  # the fused path keeps no logits
    buffers = fused_workspace(plan, scored, rows, rows_plan.update_in_backward, rows_plan.chunk_size,
                              1 + rows_plan.hard_negatives) if fused else 0
    return {
        "classifier weights": shard,
        "classifier gradients": 0 if rows_plan.update_in_backward else shard,
        "classifier momentum": shard if plan.momentum else 0,
        "logits/activations (chunk workspace)": 0 if fused else chunk_workspace(plan, scored, chunk),
        "fused kernel buffers": buffers,
        "top-K smoothing (hard negatives, targets)": smoothing_state(plan, rows_plan, rows, scored),
        "logits cache": cache if cached else 0,
        "CO2 term (chunk scratch)": co2_scratch(plan, rows_plan.co2, scored, chunk),
    }


def rows_checkpoint_bytes(plan: PlanInput, rows_plan: ClassifierRows | SampledRows) -> int:
    """What a save stages of the rank's rows: W and its momentum, and the hard-negative table; PIC's
    rows off the device are left out, as the row store itself is."""
    if isinstance(rows_plan, SampledRows) and rows_plan.row_store != "device":
        return 0
    row_bytes = plan.dim * 4 * (2 if plan.momentum else 1)
    if isinstance(rows_plan, ClassifierRows):
        row_bytes += rows_plan.hard_negatives * 8
    return local_rows(plan, rows_plan) * row_bytes
