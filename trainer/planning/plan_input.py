"""What the planner is asked: one job's shape (``PlanInput``), and the settings it reads from a
DeepSpeed config.

The job's facts (ranks, global batch, views, D, dtype, device, backbone, its optimizer, ZeRO,
DALI) are fields here.  The objective's side is the objective's own description
(``ObjectiveConfig.memory_plan``, ``trainer.objectives.memory_plan``) in ``objective``; without one
(`instcls plan --num-classes N`), ``mode`` and the classifier flags below describe an N-way
classifier (DDP, DHP) or PIC, the three the flag-driven plan compares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.classifier.kernel.chunked import KernelSettings
from trainer.objectives.memory_plan import ClassifierRows, ObjectiveMemoryPlan, SampledRows
from trainer.optim import optimizer_names, optimizer_spec

GIB = 2**30
CPU_BUFFERS = 8 * 2**20
UNBOUNDED_CLASSES = 10**12  # "any N": device memory does not grow with N (PIC with rows off the device)
GPU_BUFFERS = 1 * GIB
DEEPSPEED_REDUCE_BUCKET = 500_000_000  # elements: DeepSpeed's default reduce_bucket_size
DEEPSPEED_PREFETCH_BUCKET = 50_000_000  # elements: DeepSpeed's default stage3_prefetch_bucket_size
DALI_PREFETCH_DEPTH = 2  # output batches DALI keeps ahead (data.loader.prefetch_depth's default)
DECODED_IMAGE_BYTES = 500 * 400 * 3  # an average ImageNet image decoded (uint8 HWC), before cropping
FLAG_MODES = ("ddp", "dhp", "pic")  # what the flag-driven plan compares
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class PlanInput:
    mode: str  # the objective plan's kind: "ddp", "dhp", "pic" (flags), or ``objective.kind`` ("swav", ...)
    num_classes: int  # N, instances in the training set
    ranks: int
    batch: int = 4096  # global images per step
    dim: int = 128
    # The classifier of the flag-driven plan (ignored when ``objective`` is given):
    chunk_size: int = 65536
    logits_cache_bytes: int = 0  # the classifier's budget: the cache exists only if it fits whole
    update_in_backward: bool = False  # DHP: W's gradient never materialised
    queue: int = 65536  # pic: K recent ids scored besides the batch
    row_store: str = "host"  # pic: "device" keeps W and momentum on the device; "host"/"disk" do not
    co2: bool = False  # CO2's consistency term (two global views): its chunk scratch in the backward
    kernel: str = "auto"  # the classifier's path: auto = fused on GPUs without CO2, chunked otherwise
    targets: int = 1  # target rows per sample: the instance, plus K hard negatives with top-K smoothing
    # The objective's own description (``ObjectiveConfig.memory_plan``): a job config's objective.
    objective: ObjectiveMemoryPlan | None = None
    dtype: str = "float32"  # dtype of features / backbone compute
    momentum: bool = True  # the job's SGD momentum (classifier rows; the backbone's SGD and LARS)
    backbone: str | None = None  # model.arch: a name of the backbone registry (trainer.models.backbones)
    optimizer: str = "sgd"  # optim.name: the backbone's optimizer (trainer.optim), its state per parameter
    activation_checkpointing: bool = False  # each residual unit keeps its input only, recomputed in the backward
    head_hidden_dim: int = 2048  # the MLP head's hidden width (model.head_hidden_dim)
    image_size: int = 224
    img_size: int | None = None  # ViTs: model.img_size, the side their position grid is laid out for
    patch_size: int | None = None  # ViTs: model.patch_size
    views: int = 2
    view_sides: tuple[int, ...] = ()  # each view's side (multi-crop's small crops); () = views x image_size
    zero_stage: int = 0
    device: str = "gpu"  # "gpu" adds the CUDA context + NCCL buffers
    reduce_bucket: int = DEEPSPEED_REDUCE_BUCKET  # ZeRO's reduce_bucket_size (elements)
    overlap_comm: bool = False  # ZeRO's overlap_comm: a second gradient bucket
    prefetch_bucket: int = DEEPSPEED_PREFETCH_BUCKET  # ZeRO-3's stage3_prefetch_bucket_size (elements)
    fp32_gradients: bool = False  # bf16 backbone, gradients reduced and kept in fp32 (ds_configs/*_bf16.json)
    fp32_weights: bool = False  # bf16 compute under torch.autocast: fp32 weights and gradients, no master copy
    dali: bool = True  # GPU decoding and augmentation with DALI (its buffers on the device)
    dali_prefetch: int = DALI_PREFETCH_DEPTH  # batches DALI prepares ahead (data.loader.prefetch_depth)
    checkpoints: bool = False  # the job saves in the background (checkpoint.every_steps / every_epochs)
    teacher: bool = False  # the objective keeps a momentum teacher: an fp32 copy of the network on every rank
    runtime_bytes: int = 0  # CPU: a rank's RSS before any tensor (Python, torch, DeepSpeed, DALI), measured

    def __post_init__(self) -> None:
        if self.objective is None and self.mode not in FLAG_MODES:
            raise ValueError(f"--mode {self.mode!r}: choose ddp, dhp or pic")
        if self.objective is not None and self.mode != self.objective.kind:
            raise ValueError(f"mode={self.mode!r} names another plan than the objective's ({self.objective.kind!r}): "
                             "pass mode=objective.kind")
        if self.ranks < 1 or self.batch % self.ranks:
            raise ValueError(f"--batch {self.batch} must be a multiple of --ranks {self.ranks}")
        if self.logits_cache_bytes < 0:
            raise ValueError("--logits-cache-gib must be >= 0 (0 recomputes the logits in the backward)")
        if self.update_in_backward and self.mode != "dhp":
            raise ValueError("--update-in-backward applies to dhp only (ddp must all-reduce W's gradient first)")
        if self.optimizer not in optimizer_names():
            raise ValueError(f"--optimizer {self.optimizer!r}: choose one of {', '.join(optimizer_names())}")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"--zero-stage {self.zero_stage!r}: choose one of {ZERO_STAGES}")
        if self.view_sides and len(self.view_sides) != self.views:
            raise ValueError(f"view_sides={self.view_sides} must give the side of each of the {self.views} views")

    @property
    def sides(self) -> tuple[int, ...]:
        """The side of every view of a sample."""
        return self.view_sides or (self.image_size,) * self.views

    @property
    def objective_plan(self) -> ObjectiveMemoryPlan:
        """The objective's description: the config's, or the one the flags describe for ``mode``."""
        if self.objective is not None:
            return self.objective
        if self.mode == "pic":
            return SampledRows(queue_size=self.queue, row_store=self.row_store, chunk_size=self.chunk_size,
                               kernel=self.kernel, co2=self.co2)
        return ClassifierRows(sharded=self.mode == "dhp", chunk_size=self.chunk_size,
                              logits_cache_bytes=self.logits_cache_bytes, kernel=self.kernel,
                              hard_negatives=self.targets - 1, co2=self.co2, update_in_backward=self.update_in_backward)

    @property
    def fused(self) -> bool:
        """Whether the objective's classifier runs the fused kernels: the kernel's own choice for this device."""
        plan = self.objective_plan
        return isinstance(plan, (ClassifierRows, SampledRows)) and self.runs_fused(plan.kernel, plan.co2)

    def runs_fused(self, kernel: str, co2: bool) -> bool:
        """Whether a classifier with this ``kernel`` setting (and CO2 or not) runs the fused kernels here."""
        device = torch.device("cuda" if self.device == "gpu" else "cpu")
        return KernelSettings(implementation=kernel).resolved_implementation(device, co2) == "fused"


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def optimizer_state_bytes(plan: PlanInput) -> int:
    """fp32 state the job's optimizer keeps per parameter it steps (``OptimizerSpec``: SGD's and LARS's
    momentum 4, AdamW's two moments 8).  SGD without momentum keeps none (LARS keeps its buffer
    whatever the momentum)."""
    if plan.optimizer == "sgd" and not plan.momentum:
        return 0
    return optimizer_spec(plan.optimizer).state_bytes_per_parameter


def deepspeed_settings(ds_config: dict) -> dict:
    """``PlanInput`` fields from a DeepSpeed config (``ds_configs/*.json``)."""
    zero = ds_config.get("zero_optimization", {})
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    fp32_gradients = bf16 and ds_config.get("data_types", {}).get("grad_accum_dtype") in ("fp32", "float32")
    autocast = ds_config.get("torch_autocast", {})
    autocast_bf16 = bool(autocast.get("enabled")) and str(autocast.get("dtype", "bfloat16")) in ("bfloat16", "bf16",
                                                                                                 "torch.bfloat16")
    return {"zero_stage": int(zero.get("stage", 0)),
            "reduce_bucket": int(float(zero.get("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET))),
            "overlap_comm": bool(zero.get("overlap_comm", False)),
            "prefetch_bucket": int(float(zero.get("stage3_prefetch_bucket_size", DEEPSPEED_PREFETCH_BUCKET))),
            "fp32_gradients": fp32_gradients or autocast_bf16,
            "fp32_weights": autocast_bf16,
            "dtype": "bfloat16" if bf16 or autocast_bf16 else "float32"}
