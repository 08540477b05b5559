"""The network: a trunk from the backbone registry (``trainer.models.backbones``: torchvision's
ResNets, timm's ViTs) with a 2-layer MLP head (or, for the paper's Table 2 ablation, a linear one)
to the classifier's feature width.  Nothing here knows a family's modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainer.models.activation_checkpointing import checkpoint_units
from trainer.models.backbones import check_settings, get_backbone
from trainer.models.batch_norm_precision import accept_low_precision_parameters
from trainer.parallel.batch_norm import BATCH_NORM_MODES, SYNC_GROUPS

HEADS = ("mlp", "linear")
INPUT_NORMS = ("none", "per_image")
INIT_FROM_PARTS = ("student", "teacher")  # the networks of a file that holds two (trainer.checkpoint.weight_layouts)


@dataclass(frozen=True)
class ModelConfig:
    """Attributes:
    arch: a name of the backbone registry (``trainer.models.backbones.backbone_names()``; weights are
        never downloaded: training starts from random init).  torchvision's ResNets: ``resnet10``
        (one basic block per stage: ResNet-18's widths at about 40% of its compute, for CPU demos),
        ``resnet18``, ``resnet34``, ``resnet50``, ``resnet101``.  timm's ViTs, by timm's name:
        ``vit_tiny_patch16_224`` (ViT-Ti), ``vit_small_patch16_224``, ``vit_base_patch16_224``,
        ``vit_large_patch16_224``, ``vit_huge_patch14_224``.
    small_input_stem: ResNets only: 3x3 stride-1 first convolution and no max-pool, for ~32 px inputs.
    img_size: ViTs only: the image side the position embeddings are laid out for (unset: the name's,
        224).  Views of other sizes (multi-crop's small crops) get them resampled in the forward.
    patch_size: ViTs only: the side of a patch, one token each (unset: the name's, 16 or 14); 4 for
        32 px images gives an 8 x 8 grid.  ``img_size`` must be a multiple of it.
    pool: ViTs only: the trunk's feature, "token" (the class token, the default; unset means it) or
        "avg" (the mean of the patch tokens, timm's ``global_pool="avg"``).
    input_norm: "none" (default) or "per_image": standardise each image's channels to mean 0 and
        variance 1 over its pixels before the trunk (``nn.InstanceNorm2d`` without parameters), in
        training and evaluation alike.  It removes an image's flat colours and overall contrast, so
        that the network sees its shapes; the digit scenes' ViT-Ti learns with it
        (docs/results.md).  No parameters: checkpoints load with it on or off.
    head: "mlp" (linear, BatchNorm, ReLU, linear: the paper's) or "linear" (one linear layer, the
        head the paper's Table 2 compares it with).
    head_hidden_dim: width of the MLP head's hidden layer (2048 in the paper).
    feature_dim: output width D of the head, the classifier's input (128 in the paper).
    channels_last: feed the network NHWC (``torch.channels_last``), the layout cuDNN's tensor-core
        convolutions run in bf16 (NVIDIA's ResNet-50 trains NHWC).  The batch takes it in the same
        copy that casts it to the engine's dtype, and every convolution then keeps it (torch picks
        a convolution's layout from its input).  The weights stay contiguous: DeepSpeed broadcasts
        and flattens parameters as plain contiguous memory (ZeRO's partitions), so each convolution
        reads its weight in NHWC order itself, a copy of the weight, far smaller than the activations.
        Same numbers as NCHW up to the convolution algorithm's rounding (a test checks them on CPU).
    compile: ``torch.compile`` the network (``nn.Module.compile``: the state dict and checkpoints keep
        their names).  The first steps pay the compile; inductor's cache (``TORCHINDUCTOR_CACHE_DIR``)
        keeps it for later pods.  Opt-in.
    activation_checkpointing: keep only each residual unit's input for the backward (the registry
        entry's ``blocks``: ResNet blocks, ViT blocks) and recompute the unit in the backward: the
        trunk's saved activations drop to the units' inputs plus one unit's (``trainer.models.profile``
        measures both), for about one more forward of the trunk per step.  Training-mode
        forwards with grad only; the recomputation leaves BatchNorm running statistics as the
        first forward left them, and the state dict's names do not change (checkpoints load with
        it on or off).  See ``trainer.models.activation_checkpointing``.  Off by default.
    init_from: start the backbone from these weights instead of random init: an export's
        ``model.safetensors`` (or the export's folder), a plain timm or torchvision state dict
        (``.pth``/``.pt`` or ``.safetensors``, with the keys of the library's network), another
        run's checkpoint folder (its ``model.pt``), or a self-supervised method's checkpoint (MoCo
        v2's, DINO's full checkpoint, a BYOL learner's of lucidrains/byol-pytorch: the log names the
        layout recognised and the prefix stripped; ``trainer.checkpoint.weight_layouts``).  Loaded
        before the first step; the classifier keys such files carry (``fc.*``, ``head.*``, MoCo
        v2's MLP ``fc.0``/``fc.2``) are dropped and listed in the log, and the head
        and the objective's rows start as they would (the contrastive prior is computed from the
        loaded backbone).  A resume ignores it: the checkpoint's weights win.  The file's digest goes
        into the run's provenance (``run.json``), not its fingerprint.  See
        ``trainer.checkpoint.initial_weights``.
    init_strict: with ``init_from``, every backbone tensor must be in the file and every tensor of
        the file must belong to the backbone (true, default); false loads the tensors that match
        and logs every missing and unexpected key.  A tensor whose shape differs is refused either
        way, naming it.
    init_from_part: with an ``init_from`` file that holds a student and a momentum teacher, which
        one starts the backbone: "student" or "teacher"; unset, the one the method's own evaluations
        use (DINO's teacher, MoCo v2's query encoder, BYOL's online network).  Refused for a file
        that holds one network.
    batch_norm: how the data-parallel ranks share BatchNorm: "local" (each rank's own batch
        statistics, PIC's and One-Million-Way's choice; the running statistics are averaged over the
        ranks before every evaluation and save, so every rank holds, scores and saves one
        network) or "sync" (the global batch's statistics, SwAV's choice: ``SyncBatchNorm`` of
        ``trainer.parallel.sync_batch_norm``, on any device, no host read).  See
        ``trainer.parallel.batch_norm``.
    sync_batch_norm_group: with ``batch_norm: sync``, the ranks whose batches make the statistics:
        "world" (every data-parallel rank) or "node" (the ranks of one node, as SwAV's code
        synchronises groups of 8 GPUs: one small all-gather per layer within the node's fast links
        instead of across the cluster).  Under "node" the nodes' running statistics differ; they
        are averaged over every rank before each evaluation and save, as under ``local``.
    """

    arch: str = "resnet50"
    small_input_stem: bool = False
    img_size: int | None = None
    patch_size: int | None = None
    pool: str | None = None
    input_norm: str = "none"
    head: str = "mlp"
    head_hidden_dim: int = 2048
    feature_dim: int = 128
    batch_norm: str = "local"
    sync_batch_norm_group: str = "world"
    channels_last: bool = False
    compile: bool = False
    activation_checkpointing: bool = False
    init_from: Path | None = None
    init_strict: bool = True
    init_from_part: str | None = None

    def __post_init__(self) -> None:
        check_settings(self)  # arch in the registry; the family's own fields only, with values it builds
        if self.input_norm not in INPUT_NORMS:
            raise ValueError(f"input_norm={self.input_norm!r} is invalid: use none or per_image (standardise each "
                             f"image's channels before the trunk)")
        if self.head not in HEADS:
            raise ValueError(f"head={self.head!r} is invalid: choose one of {HEADS}")
        for name in ("head_hidden_dim", "feature_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: use a width >= 1")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing={self.activation_checkpointing!r} is invalid: use true "
                             "(recompute each residual unit in the backward) or false")
        if not isinstance(self.init_strict, bool):
            raise ValueError(f"init_strict={self.init_strict!r} is invalid: use true (every backbone tensor from the "
                             "file) or false (what matches, the rest logged)")
        if self.init_from_part is not None and self.init_from_part not in INIT_FROM_PARTS:
            raise ValueError(f"init_from_part={self.init_from_part!r} is invalid: choose student or teacher (the "
                             "network of a MoCo v2, DINO or BYOL checkpoint to start from), or leave it unset for "
                             "the method's default")
        if self.init_from_part is not None and self.init_from is None:
            raise ValueError(f"init_from_part={self.init_from_part} picks a network of model.init_from's file, and "
                             "model.init_from is unset: set model.init_from, or remove model.init_from_part")
        if self.batch_norm not in BATCH_NORM_MODES:
            raise ValueError(f"batch_norm={self.batch_norm!r} is invalid: use local (per-rank statistics, averaged "
                             "before every evaluation and save) or sync (statistics of the global batch)")
        if self.sync_batch_norm_group not in SYNC_GROUPS:
            raise ValueError(f"sync_batch_norm_group={self.sync_batch_norm_group!r} is invalid: use world (every "
                             "rank's batch) or node (the batches of one node's ranks)")
        if self.sync_batch_norm_group != "world" and self.batch_norm != "sync":
            raise ValueError(f"sync_batch_norm_group={self.sync_batch_norm_group} applies to batch_norm: sync only; "
                             f"this config has batch_norm: {self.batch_norm}. Set model.batch_norm=sync, or remove "
                             "model.sync_batch_norm_group")


class InstanceModel(nn.Module):
    """``forward(images) -> head features [b, D]``; ``backbone_features(images) -> [b, F]`` is the
    representation that kNN and linear evaluation use.

    ``forward`` also takes a list of batches (multi-crop's crop sizes, one batch per size) and returns
    their features in a list, looping inside: a step is then one top-level call of the engine's
    forward, as SwAV's multi-crop wrapper makes it.  ZeRO-3 needs that: DeepSpeed resets its
    parameter trace at every top-level forward, so two calls a step never complete the trace and
    nothing is prefetched (``deepspeed/runtime/zero/parameter_offload.py``)."""

    def __init__(self, backbone: nn.Module, backbone_dim: int, config: ModelConfig) -> None:
        super().__init__()
        self.backbone = backbone
        self.backbone_width = backbone_dim
        # no parameters or buffers (affine and running statistics off): the state dict is unchanged
        self.input_norm = nn.InstanceNorm2d(3) if config.input_norm == "per_image" else nn.Identity()
        if config.head == "linear":
            self.head = nn.Linear(backbone_dim, config.feature_dim)
        else:
            self.head = nn.Sequential(
                nn.Linear(backbone_dim, config.head_hidden_dim),
                nn.BatchNorm1d(config.head_hidden_dim),
                nn.ReLU(inplace=True),
                nn.Linear(config.head_hidden_dim, config.feature_dim),
            )

    def backbone_features(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(self.input_norm(images))

    def forward(self, images: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(images, (list, tuple)):
            return [self.head(self.backbone_features(batch)) for batch in images]
        return self.head(self.backbone_features(images))


def model_input(images: torch.Tensor, dtype: torch.dtype, config: ModelConfig) -> torch.Tensor:
    """The loader's batch as the network takes it: one copy that casts to the engine's ``dtype`` and,
    with ``channels_last``, lays it out NHWC."""
    layout = torch.channels_last if config.channels_last and images.dim() == 4 else torch.preserve_format
    return images.to(dtype=dtype, memory_format=layout)


def build_model(config: ModelConfig) -> InstanceModel:
    """The registry's trunk for ``config.arch`` at random init, with the head on top."""
    backbone = get_backbone(config.arch)
    trunk = backbone.build(config)
    if config.activation_checkpointing:
        checkpoint_units(backbone.blocks(trunk.module))
    # BatchNorm that a bf16 DeepSpeed engine can run (bf16 parameters, fp32 statistics)
    return accept_low_precision_parameters(InstanceModel(trunk.module, trunk.width, config))
