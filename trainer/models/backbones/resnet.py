"""torchvision's ResNets (weights are never downloaded: training starts from random init).

``resnet10`` is torchvision's ResNet with one basic block per stage: ResNet-18's widths at about
40% of its compute, for CPU demos.  ``small_input_stem`` swaps the 7x7/2 convolution + max-pool for
a 3x3/1 convolution, the usual choice for 32-pixel images; at 224 pixels keep the standard stem.
An export (``resnet_library_network``) is the same ResNet built by torchvision alone, ``fc`` dropped.
"""

from __future__ import annotations

from functools import partial

import torchvision
from torch import nn

from trainer.models.backbones.registry import Backbone, LibraryNetwork, Trunk, TrunkSettings, register_backbone

RESNETS = ("resnet10", "resnet18", "resnet34", "resnet50", "resnet101")


def build_resnet(name: str, settings: TrunkSettings) -> Trunk:
    if name == "resnet10":
        network = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1])
    else:
        network = getattr(torchvision.models, name)(weights=None)
    if settings.small_input_stem:
        network.conv1 = nn.Conv2d(3, network.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        network.maxpool = nn.Identity()
    width = network.fc.in_features
    network.fc = nn.Identity()  # the trunk ends at the pooled features
    return Trunk(network, width)


def resnet_library_network(name: str, settings: TrunkSettings) -> LibraryNetwork:
    """``build_resnet``'s trunk as torchvision code: the constructor, the small stem's two swaps and
    no ``fc`` (the exported weights have none: the backbone ends at the pooled features)."""
    if name == "resnet10":
        code = ["network = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1])"]
    else:
        code = [f"network = torchvision.models.{name}(weights=None)"]
    if settings.small_input_stem:  # the same swaps as build_resnet's
        code += ["network.conv1 = torch.nn.Conv2d(3, network.conv1.out_channels, kernel_size=3, stride=1, padding=1, "
                 "bias=False)",
                 "network.maxpool = torch.nn.Identity()"]
    code.append("network.fc = torch.nn.Identity()  # the backbone ends at the pooled features")
    return LibraryNetwork(library="torchvision", architecture=name, imports=("import torch", "import torchvision"),
                          code=tuple(code))


def resnet_blocks(network: nn.Module) -> list[nn.Module]:
    return [block for stage in (network.layer1, network.layer2, network.layer3, network.layer4) for block in stage]


def _any_size(settings: TrunkSettings) -> None:
    """A ResNet takes any input size; its only option is the stem."""


for _name in RESNETS:
    register_backbone(Backbone(name=_name, family="resnet", build=partial(build_resnet, _name),
                               options=frozenset({"small_input_stem"}), check=_any_size, blocks=resnet_blocks,
                               export=partial(resnet_library_network, _name)))
