"""`instcls plan`: per-GPU (or per-rank) memory of a job, before it is launched.

The classifier part is first-principles: W, its gradient and SGD momentum for the rows a rank
holds, the chunk workspace of ``ChunkWorkspace`` (logits and weight buffers), and the logits cache
(fp32 ``exp(z)`` of every scored sample and class) when its budget holds it.  On this
machine it is within 1-6% of the measured peaks of `bench ddp-vs-dhp` above a few MiB (a test
holds it to 15%).  The backbone part counts parameters, gradients and momentum with ZeRO's
partitioning, and activations as the bytes autograd saves for backward, found by running one
forward on the meta device (exact for the architecture and image size, no compute).

On a GPU three more things take memory that ``max_memory_allocated`` never sees or that the model
alone does not show: ZeRO's gradient buckets (``reduce_bucket_size`` elements in the dtype gradients
are reduced in, a second one with ``overlap_comm``; DeepSpeed's default is 5e8 elements, 1 GB in
bf16; ZeRO-3 adds its parameter prefetch bucket, ``stage3_prefetch_bucket_size`` 16-bit elements),
DALI's pipeline buffers (its prefetched output batches and the decoded images), and the CUDA
context with NCCL's buffers (about 1 GiB).  On CPU ranks ``buffers`` is a few MiB; there the rank's
memory is host memory, so the plan adds the runtime itself (Python, torch, DeepSpeed, DALI: about
1.1 GiB, measured by `instcls plan --cpu` in a fresh process, ``runtime_baseline``) and the host copies
that background checkpoints keep (``checkpoint_host_copies``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainer.classifier.kernel.chunk_workspace import LogitsCache
from trainer.classifier.kernel.chunked import KernelSettings
from trainer.models import ModelConfig
from trainer.models.profile import model_profile

GIB = 2**30
CPU_BUFFERS = 8 * 2**20
UNBOUNDED_CLASSES = 10**12  # "any N": device memory does not grow with N (PIC with rows off the device)
GPU_BUFFERS = 1 * GIB
DEEPSPEED_REDUCE_BUCKET = 500_000_000  # elements: DeepSpeed's default reduce_bucket_size
DEEPSPEED_PREFETCH_BUCKET = 50_000_000  # elements: DeepSpeed's default stage3_prefetch_bucket_size
DALI_PREFETCH_DEPTH = 2  # output batches DALI keeps ahead (data.loader.prefetch_depth's default)
DECODED_IMAGE_BYTES = 500 * 400 * 3  # an average ImageNet image decoded (uint8 HWC), before cropping


@dataclass(frozen=True)
class PlanInput:
    mode: str  # "ddp" (replicated W), "dhp" (sharded W) or "pic" (sharded W, sampled rows)
    num_classes: int
    ranks: int
    batch: int = 4096  # global images per step
    dim: int = 128
    chunk_size: int = 65536
    logits_cache_bytes: int = 0  # the classifier's budget: the cache exists only if it fits whole
    dtype: str = "float32"  # dtype of features / backbone compute
    momentum: bool = True
    update_in_backward: bool = False  # DHP: W's gradient never materialised
    backbone: str | None = None  # model.arch: a name of the backbone registry (trainer.models.backbones)
    head_hidden_dim: int = 2048  # the MLP head's hidden width (model.head_hidden_dim)
    image_size: int = 224
    img_size: int | None = None  # ViTs: model.img_size, the side their position grid is laid out for
    patch_size: int | None = None  # ViTs: model.patch_size
    views: int = 2
    zero_stage: int = 0
    device: str = "gpu"  # "gpu" adds the CUDA context + NCCL buffers
    queue: int = 65536  # pic: K recent ids scored besides the batch
    row_store: str = "host"  # pic: "device" keeps W and momentum on the device; "host"/"disk" do not
    co2: bool = False  # CO2's consistency term (two global views): its chunk scratch in the backward
    reduce_bucket: int = DEEPSPEED_REDUCE_BUCKET  # ZeRO's reduce_bucket_size (elements)
    overlap_comm: bool = False  # ZeRO's overlap_comm: a second gradient bucket
    prefetch_bucket: int = DEEPSPEED_PREFETCH_BUCKET  # ZeRO-3's stage3_prefetch_bucket_size (elements)
    fp32_gradients: bool = False  # bf16 backbone, gradients reduced and kept in fp32 (ds_configs/*_bf16.json)
    dali: bool = True  # GPU decoding and augmentation with DALI (its buffers on the device)
    dali_prefetch: int = DALI_PREFETCH_DEPTH  # batches DALI prepares ahead (data.loader.prefetch_depth)
    kernel: str = "auto"  # the classifier's path: auto = fused on GPUs without CO2, chunked otherwise
    targets: int = 1  # target rows per sample: the instance, plus K hard negatives with top-K smoothing
    checkpoints: bool = False  # the job saves in the background (checkpoint.every_steps / every_epochs)
    runtime_bytes: int = 0  # CPU: a rank's RSS before any tensor (Python, torch, DeepSpeed, DALI), measured

    @property
    def fused(self) -> bool:
        """Whether the classifier runs the fused kernels: the kernel's own choice for this device."""
        device = torch.device("cuda" if self.device == "gpu" else "cpu")
        return KernelSettings(implementation=self.kernel).resolved_implementation(device, self.co2) == "fused"

    def __post_init__(self) -> None:
        if self.mode not in ("ddp", "dhp", "pic"):
            raise ValueError(f"--mode {self.mode!r}: choose ddp, dhp or pic")
        if self.ranks < 1 or self.batch % self.ranks:
            raise ValueError(f"--batch {self.batch} must be a multiple of --ranks {self.ranks}")
        if self.logits_cache_bytes < 0:
            raise ValueError("--logits-cache-gib must be >= 0 (0 recomputes the logits in the backward)")
        if self.update_in_backward and self.mode != "dhp":
            raise ValueError("--update-in-backward applies to dhp only (ddp must all-reduce W's gradient first)")


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def co2_scratch(plan: PlanInput, scored: int, chunk: int) -> int:
    """CO2's term (``trainer.classifier.terms.co2``) reuses the kernel's chunk buffers.  Its fused
    backward (inductor, on every device) writes a chunk's ``dL/dz`` into one fresh ``[chunk, columns]``
    fp32 block, since inductor does not overwrite an input it reads across views."""
    return scored * chunk * 4 if plan.co2 else 0


def fused_workspace(plan: PlanInput, scored: int, rows: int, row_buffer: bool) -> int:
    """The fused path's buffers (``trainer.classifier.kernel.fused``): no logits anywhere.  Held through
    the backward: the scored rows' norms and the features' gradient.  Then, one after the other, the
    feature-gradient partials over ``FUSED_SPLITS`` programs per feature block (summed and freed), and
    the target passes: one column group of gathered target rows at a time, three fp32 ``[B, group, D]``
    temporaries beside the features' fp32 copy.  The larger of those two phases counts.  A chunk of
    rows' gradient is added where it cannot be written in place (in-backward SGD, sampled rows)."""
    from trainer.classifier.kernel.fused import FUSED_SPLITS_ON_FAKE_DEVICES, TARGET_COLUMNS_PER_PASS, padded_dim

    splits = FUSED_SPLITS_ON_FAKE_DEVICES
    softmax_partials = splits * scored * (4 + padded_dim(plan.dim) * 4)
    target_pass = 3 * scored * min(TARGET_COLUMNS_PER_PASS, plan.targets) * plan.dim * 4 + scored * plan.dim * 4
    workspace = rows * 4 + scored * plan.dim * 4 + max(softmax_partials, target_pass)
    if row_buffer:
        workspace += (min(plan.chunk_size, rows) + 1) * plan.dim * 4
    return workspace


def smoothing_state(plan: PlanInput, rows: int, scored: int) -> int:
    """Top-K smoothing (``trainer.classifier.hard_negatives``), on either path: the search's table (the K
    hardest negatives of each local row, int64), its inversion kept for the step's lookups when the
    rows are sharded (each entry held by its negative's owner: instance int64, slot int16, column
    int32; about ``rows * K`` entries on each rank), and each scored sample's K+1 target columns
    (int64) with their smoothing coefficients and gradients (fp32)."""
    top_k = plan.targets - 1
    if top_k <= 0:
        return 0
    inverted = (rows * top_k + 1) * (8 + 2 + 4) if plan.mode == "dhp" and plan.ranks > 1 else 0
    return rows * top_k * 8 + inverted + scored * plan.targets * (8 + 4 + 4)


def _chunk_workspace(plan: PlanInput, scored: int, chunk: int) -> int:
    workspace = scored * chunk * (4 + (_element_size(plan.dtype) if plan.dtype != "float32" else 0))
    return workspace + 2 * chunk * plan.dim * 4 + chunk * 4 + scored * plan.dim * (4 + _element_size(plan.dtype))


def pic_breakdown(plan: PlanInput) -> dict[str, int]:
    """PIC: a step scores the batch's ids plus K recent ids, about (K + batch) / T rows per rank
    (fewer when ids repeat), fetched with their momentum; the leaf the kernel differentiates shares
    the fetched fp32 rows, so the gradient is the third copy.  W and its momentum count on the
    device only for ``row_store: device``."""
    shard = -(-plan.num_classes // plan.ranks) * plan.dim * 4
    sampled = min(-(-(plan.queue + plan.batch) // plan.ranks), -(-plan.num_classes // plan.ranks))
    on_device = plan.row_store == "device"
    scored = plan.batch * plan.views
    chunk = min(plan.chunk_size, sampled)
    fused = plan.fused
    return {
        "classifier weights": shard if on_device else 0,
        "classifier momentum": shard if on_device and plan.momentum else 0,
        "sampled rows (W, momentum, gradient)": 3 * sampled * plan.dim * 4,
        "logits/activations (chunk workspace)": 0 if fused else _chunk_workspace(plan, scored, chunk),
        "fused kernel buffers": fused_workspace(plan, scored, sampled, row_buffer=True) if fused else 0,
        "CO2 term (chunk scratch)": co2_scratch(plan, scored, chunk),
    }


def classifier_breakdown(plan: PlanInput) -> dict[str, int]:
    if plan.mode == "pic":
        return pic_breakdown(plan)
    rows = plan.num_classes if plan.mode == "ddp" else -(-plan.num_classes // plan.ranks)
    scored = plan.batch * plan.views // plan.ranks * (1 if plan.mode == "ddp" else plan.ranks)
    chunk = min(plan.chunk_size, rows)
    shard = rows * plan.dim * 4
    fused = plan.fused
    cache = LogitsCache.size_bytes(scored, rows)
    cached = not fused and cache <= plan.logits_cache_bytes  # the fused path keeps no logits
    return {
        "classifier weights": shard,
        "classifier gradients": 0 if plan.update_in_backward else shard,
        "classifier momentum": shard if plan.momentum else 0,
        "logits/activations (chunk workspace)": 0 if fused else _chunk_workspace(plan, scored, chunk),
        "fused kernel buffers": fused_workspace(plan, scored, rows, row_buffer=plan.update_in_backward) if fused else 0,
        "top-K smoothing (hard negatives, targets)": smoothing_state(plan, rows, scored),
        "logits cache": cache if cached else 0,
        "CO2 term (chunk scratch)": co2_scratch(plan, scored, chunk),
    }


def _backbone_profile(plan: PlanInput) -> tuple[int, int]:
    """``(parameters, activation bytes per image in fp32)`` of the network (trunk and head), from one
    forward on the meta device (``trainer.models.profile``)."""
    profile = model_profile(ModelConfig(arch=plan.backbone, head_hidden_dim=plan.head_hidden_dim, feature_dim=plan.dim,
                                        img_size=plan.img_size, patch_size=plan.patch_size), plan.image_size)
    return profile.parameters, profile.activation_bytes


def backbone_breakdown(plan: PlanInput) -> dict[str, int]:
    if plan.backbone is None:
        return {}
    parameters, activation_fp32 = _backbone_profile(plan)
    half = plan.dtype != "float32"
    stage, ranks = plan.zero_stage, plan.ranks
    weights = parameters * (2 if half else 4) / (ranks if stage >= 3 else 1)
    gradients = parameters * (2 if half and not plan.fp32_gradients else 4) / (ranks if stage >= 2 else 1)
    # Optimizer state: momentum, plus an fp32 master copy under bf16/fp16.
    optimizer_state = parameters * ((4 if plan.momentum else 0) + (4 if half else 0)) / (ranks if stage >= 1 else 1)
    local_images = plan.batch // ranks * plan.views
    activations = activation_fp32 * local_images * (_element_size(plan.dtype) / 4)
    return {
        "backbone weights": int(weights),
        "backbone gradients": int(gradients),
        "backbone optimizer state": int(optimizer_state),
        "backbone activations": int(activations),
    }


def checkpoint_host_copies(plan: PlanInput) -> dict[str, int]:
    """What a background save leaves in host memory for the next one (``trainer.checkpoint.save_plan``),
    on rank 0, which holds the most.  ``HostStager``: a copy of every tensor the save writes from
    the live state, that is this rank's classifier rows (W, its momentum, the hard-negative table)
    and DeepSpeed's files (rank 0's module states; the optimizer state, partitioned by ZeRO >= 1);
    ``HostBuffers``: rank 0's fp32 network and optimizer state for ``model.pt`` and ``optimizer.pt``.
    Counted on CPU ranks only: on a GPU they are pinned host memory, beside the device memory
    planned here.  PIC's rows off the device are left out, as the row store itself is."""
    if plan.device == "gpu" or not plan.checkpoints:
        return {}
    rows = plan.num_classes if plan.mode == "ddp" else -(-plan.num_classes // plan.ranks)
    row_bytes = plan.dim * 4 * (2 if plan.momentum else 1)
    if plan.mode != "pic" and plan.targets > 1:
        row_bytes += (plan.targets - 1) * 8
    copies = {"checkpoint copies: classifier rows": 0 if plan.mode == "pic" and plan.row_store != "device"
              else rows * row_bytes}
    if plan.backbone is not None:
        parameters, _ = _backbone_profile(plan)
        half = plan.dtype != "float32"
        optimizer = parameters * ((4 if plan.momentum else 0) + (4 if half else 0))
        partition = plan.ranks if plan.zero_stage >= 1 else 1
        copies["checkpoint copies: DeepSpeed files"] = parameters * (2 if half else 4) + optimizer // partition
        copies["checkpoint copies: model.pt, optimizer.pt"] = parameters * (8 if plan.momentum else 4)
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
        element = 4 if plan.fp32_gradients else _element_size(plan.dtype)
        breakdown["ZeRO gradient buckets"] = plan.reduce_bucket * element * buckets
        if plan.zero_stage == 3:
            breakdown["ZeRO-3 parameter prefetch bucket"] = plan.prefetch_bucket * _element_size(plan.dtype)
    if plan.dali:
        local_images = plan.batch // plan.ranks
        outputs = local_images * plan.views * 3 * plan.image_size**2 * 4  # float32 CHW views
        breakdown["DALI pipeline buffers"] = plan.dali_prefetch * outputs + local_images * DECODED_IMAGE_BYTES
    breakdown["buffers (allocator, CUDA context, NCCL)"] = GPU_BUFFERS
    return breakdown


def predict(plan: PlanInput) -> dict[str, int]:
    return classifier_breakdown(plan) | backbone_breakdown(plan) | runtime_breakdown(plan)


def deepspeed_settings(ds_config: dict) -> dict:
    """``PlanInput`` fields from a DeepSpeed config (``ds_configs/*.json``)."""
    zero = ds_config.get("zero_optimization", {})
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    fp32_gradients = bf16 and ds_config.get("data_types", {}).get("grad_accum_dtype") in ("fp32", "float32")
    return {"zero_stage": int(zero.get("stage", 0)),
            "reduce_bucket": int(float(zero.get("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET))),
            "overlap_comm": bool(zero.get("overlap_comm", False)),
            "prefetch_bucket": int(float(zero.get("stage3_prefetch_bucket_size", DEEPSPEED_PREFETCH_BUCKET))),
            "fp32_gradients": fp32_gradients,
            "dtype": "bfloat16" if bf16 else "float32"}


def total(plan: PlanInput) -> int:
    return sum(predict(plan).values())


def largest_classes(plan: PlanInput, capacity_bytes: int) -> int:
    """The largest N whose prediction fits ``capacity_bytes`` (0 if even N = ranks does not)."""
    low, high = 0, 1
    while total(replace(plan, num_classes=max(high, plan.ranks))) <= capacity_bytes and high < UNBOUNDED_CLASSES:
        low, high = high, high * 2
    while high - low > max(1, low // 1000):  # 0.1% resolution
        middle = (low + high) // 2
        if total(replace(plan, num_classes=max(middle, plan.ranks))) <= capacity_bytes:
            low = middle
        else:
            high = middle
    return low


def plan_modes(plan: PlanInput, capacity_bytes: int) -> dict[str, dict]:
    """What ``format_plan`` prints, per mode (ddp, dhp, pic): the breakdown in bytes, its total, whether
    it fits ``capacity_bytes`` and the largest N that does (None: any N).  `instcls plan --json` writes it."""
    modes = {}
    for mode in ("ddp", "dhp", "pic"):
        variant = replace(plan, mode=mode, update_in_backward=plan.update_in_backward and mode == "dhp")
        breakdown = predict(variant)
        need = sum(breakdown.values())
        largest = largest_classes(variant, capacity_bytes)
        modes[mode] = dict(breakdown=breakdown, total_bytes=need, fits=need <= capacity_bytes,
                           largest_classes=None if largest >= UNBOUNDED_CLASSES // 2 else largest)
    return modes


def format_plan(plan: PlanInput, capacity_bytes: int) -> str:
    lines = []
    for mode, planned in plan_modes(plan, capacity_bytes).items():
        verdict = "fits" if planned["fits"] else "does NOT fit"
        label = mode.upper() if mode != "pic" else f"PIC (K={plan.queue:,} recent ids, rows on {plan.row_store})"
        lines.append(f"{label}: N={plan.num_classes:,}, T={plan.ranks}, batch {plan.batch}, D={plan.dim}, "
                     f"{plan.dtype}: {planned['total_bytes'] / GIB:.2f} GiB per rank -> {verdict} in "
                     f"{capacity_bytes / GIB:g} GiB")
        for name, value in planned["breakdown"].items():
            lines.append(f"    {name:<42}{value / GIB:>10.3f} GiB")
        largest = planned["largest_classes"]
        lines.append("    largest N that fits: " + ("any (device memory does not grow with N)"
                                                     if largest is None else f"{largest:,}"))
    return "\n".join(lines)
