"""torchvision ResNets with a 2-layer MLP head (or, for the paper's Table 2 ablation, a linear
one) to the classifier's feature width.

``small_input_stem`` swaps the 7x7/2 convolution + max-pool for a 3x3/1 convolution, the usual
choice for 32-pixel images (the CPU demo); at 224 pixels keep the standard stem.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torchvision
from torch import nn

from trainer.models.batch_norm_precision import accept_low_precision_parameters
from trainer.parallel.batch_norm import BATCH_NORM_MODES

ARCHITECTURES = ("resnet10", "resnet18", "resnet34", "resnet50", "resnet101")
HEADS = ("mlp", "linear")


@dataclass(frozen=True)
class ModelConfig:
    """Attributes:
    arch: torchvision ResNet (weights are never downloaded: training starts from random init).
        ``resnet10`` is torchvision's ResNet with one basic block per stage: ResNet-18's widths at
        about 40% of its compute, for CPU demos.
    small_input_stem: 3x3 stride-1 first convolution and no max-pool, for ~32 px inputs.
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
    batch_norm: how the data-parallel ranks share BatchNorm: "local" (each rank's own batch
        statistics, PIC's and One-Million-Way's choice; the running statistics are averaged over the
        ranks before every evaluation and save, so every rank holds, scores and saves one
        network) or "sync" (``torch.nn.SyncBatchNorm`` over the ranks, SwAV's choice; CUDA only).
        See ``trainer.parallel.batch_norm``.
    """

    arch: str = "resnet50"
    small_input_stem: bool = False
    head: str = "mlp"
    head_hidden_dim: int = 2048
    feature_dim: int = 128
    batch_norm: str = "local"
    channels_last: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch={self.arch!r} is invalid: choose one of {ARCHITECTURES}")
        if self.head not in HEADS:
            raise ValueError(f"head={self.head!r} is invalid: choose one of {HEADS}")
        if self.head_hidden_dim < 1 or self.feature_dim < 1:
            raise ValueError("head_hidden_dim and feature_dim must be positive")
        if self.batch_norm not in BATCH_NORM_MODES:
            raise ValueError(f"batch_norm={self.batch_norm!r} is invalid: use local (per-rank statistics, averaged "
                             "before every evaluation and save) or sync (SyncBatchNorm over the ranks, CUDA only)")


class InstanceModel(nn.Module):
    """``forward(images) -> head features [b, D]``; ``backbone_features(images) -> [b, F]`` is the
    representation that kNN and linear evaluation use."""

    def __init__(self, backbone: nn.Module, backbone_dim: int, config: ModelConfig) -> None:
        super().__init__()
        self.backbone = backbone
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
        return self.backbone(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))


def model_input(images: torch.Tensor, dtype: torch.dtype, config: ModelConfig) -> torch.Tensor:
    """The loader's batch as the network takes it: one copy that casts to the engine's ``dtype`` and,
    with ``channels_last``, lays it out NHWC."""
    layout = torch.channels_last if config.channels_last and images.dim() == 4 else torch.preserve_format
    return images.to(dtype=dtype, memory_format=layout)


def build_model(config: ModelConfig) -> InstanceModel:
    if config.arch == "resnet10":
        backbone = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1])
    else:
        backbone = getattr(torchvision.models, config.arch)(weights=None)
    if config.small_input_stem:
        backbone.conv1 = nn.Conv2d(3, backbone.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        backbone.maxpool = nn.Identity()
    backbone_dim = backbone.fc.in_features
    backbone.fc = nn.Identity()
    # BatchNorm that a bf16 DeepSpeed engine can run (bf16 parameters, fp32 statistics)
    return accept_low_precision_parameters(InstanceModel(backbone, backbone_dim, config))
