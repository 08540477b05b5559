"""What a rank holds besides the model and the objective.

On a GPU three things take memory that ``max_memory_allocated`` never sees or that the model alone
does not show: ZeRO's gradient buckets (``reduce_bucket_size`` elements in the dtype gradients are
reduced in, a second one with ``overlap_comm``; DeepSpeed's default is 5e8 elements, 1 GB in bf16;
ZeRO-3 adds its parameter prefetch bucket, ``stage3_prefetch_bucket_size`` 16-bit elements), DALI's
pipeline buffers (its prefetched output batches and the decoded images), and the CUDA context with
NCCL's buffers (about 1 GiB).  On CPU ranks ``buffers`` is a few MiB; there the rank's memory is host
memory, so the plan adds the runtime itself (Python, torch, DeepSpeed, DALI: about 1.1 GiB, measured
by `instcls plan --cpu` in a fresh process, ``trainer.bench.runtime_baseline``) and the host copies
that background checkpoints keep (``checkpoint_host_copies``).
"""

from __future__ import annotations

from trainer.planning.backbone_memory import backbone_profile, optimizer_state_per_parameter
from trainer.planning.objective_memory import memory_model, objective_checkpoint_bytes
from trainer.planning.plan_input import (
    CPU_BUFFERS,
    DECODED_IMAGE_BYTES,
    GPU_BUFFERS,
    PlanInput,
    element_size,
    optimizer_state_bytes,
)


def checkpoint_host_copies(plan: PlanInput) -> dict[str, int]:
    """What a background save leaves in host memory for the next one (``trainer.checkpoint.save_plan``),
    on rank 0, which holds the most.  ``HostStager``: a copy of every tensor the save writes from
    the live state, that is this rank's objective state (classifier rows with their momentum and
    hard-negative table, or SwAV's prototypes and queue) and DeepSpeed's files (rank 0's module
    states; the optimizer state, partitioned by ZeRO >= 1); ``HostBuffers``: rank 0's fp32 network
    and optimizer state for ``model.pt`` and ``optimizer.pt``, and the momentum teacher's
    ``teacher/model.pt`` where the objective keeps one.  Counted on CPU ranks only: on a GPU
    they are pinned host memory, beside the device memory planned here."""
    if plan.device == "gpu" or not plan.checkpoints:
        return {}
    copies = {f"checkpoint copies: {memory_model(plan).checkpoint_label}": objective_checkpoint_bytes(plan)}
    if plan.backbone is not None:
        parameters = backbone_profile(plan).parameters
        half = plan.dtype != "float32" and not plan.fp32_weights
        optimizer = parameters * optimizer_state_per_parameter(plan)
        partition = plan.ranks if plan.zero_stage >= 1 else 1
        copies["checkpoint copies: DeepSpeed files"] = parameters * (2 if half else 4) + optimizer // partition
        copies["checkpoint copies: model.pt, optimizer.pt"] = parameters * (4 + optimizer_state_bytes(plan))
        if plan.teacher:
            copies["checkpoint copies: teacher/model.pt"] = parameters * 4
    return copies


def runtime_breakdown(plan: PlanInput) -> dict[str, int]:
    """What DeepSpeed and DALI hold on a GPU besides the model (see the module docstring); on a CPU
    rank, the runtime's own memory (when measured: ``runtime_baseline``) and the checkpoint's copies."""
    if plan.device != "gpu":
        runtime = {"runtime (measured: Python, torch, libs)": plan.runtime_bytes} if plan.runtime_bytes \
            else {}
        return {"buffers": CPU_BUFFERS} | runtime | checkpoint_host_copies(plan)
    breakdown = {}
    if plan.backbone is not None and plan.zero_stage >= 1:
        buckets = 2 if plan.overlap_comm else 1
        element = 4 if plan.fp32_gradients else element_size(plan.dtype)
        breakdown["ZeRO gradient buckets"] = plan.reduce_bucket * element * buckets
        if plan.zero_stage == 3:
            breakdown["ZeRO-3 parameter prefetch bucket"] = plan.prefetch_bucket * element_size(plan.dtype)
    if plan.dali:
        local_images = plan.batch // plan.ranks
        outputs = local_images * sum(3 * side**2 * 4 for side in plan.sides)  # float32 CHW views
        breakdown["DALI pipeline buffers"] = plan.dali_prefetch * outputs + local_images * DECODED_IMAGE_BYTES
    breakdown["buffers (allocator, CUDA context, NCCL)"] = GPU_BUFFERS
    return breakdown
