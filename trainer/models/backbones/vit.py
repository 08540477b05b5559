"""Vision Transformers from timm, at random init: ``timm.create_model(name, pretrained=False,
num_classes=0, dynamic_img_size=True)``.

The registry key is timm's model name.  ``model.img_size`` and ``model.patch_size`` override the
name's (a ViT-Ti at patch 4 for 32 px images: an 8 x 8 grid of tokens).  The trunk's feature is
the class token after the final LayerNorm, ``embed_dim`` wide, or with ``model.pool: avg`` the
LayerNorm of the mean of the patch tokens (timm's ``global_pool="avg"``; the class token still
attends, it is not pooled).  ``dynamic_img_size`` lets one network take every view of
multi-crop: a view of another size than ``img_size`` (SwAV's 96 px crops of a 224 px job, 16 px
crops of a 32 px one) gets the position embeddings resampled to its grid (bicubic) in each forward.
Sides should be multiples of the patch size: the patch embedding's convolution drops a remainder.

``timm`` is imported when a ViT is built, never before: ``import trainer`` and ResNet jobs do not
load it.  Nothing here downloads (``pretrained=False``; the tests build every entry with the
network unreachable).  An export (``vit_library_network``) is the same ``create_model`` call: the
exported weights load into it, or through timm's hub layout (``local-dir:``), under the same names.
"""

from __future__ import annotations

import json
from functools import partial

from torch import nn

from trainer.models.backbones.registry import Backbone, LibraryNetwork, Trunk, TrunkSettings, register_backbone

POOLS = ("token", "avg")  # timm's global_pool values this registry offers; unset: "token"

# timm's name -> (patch size, image size) its position grid is built for unless overridden.
VITS = {
    "vit_tiny_patch16_224": (16, 224),
    "vit_small_patch16_224": (16, 224),
    "vit_base_patch16_224": (16, 224),
    "vit_large_patch16_224": (16, 224),
    "vit_huge_patch14_224": (14, 224),
}


def vit_geometry(name: str, settings: TrunkSettings) -> tuple[int, int]:
    """``(patch_size, img_size)`` the network is built with: the config's, else the name's."""
    patch, size = VITS[name]
    return settings.patch_size or patch, settings.img_size or size


def vit_model_args(name: str, settings: TrunkSettings) -> dict[str, object]:
    """``timm.create_model``'s keyword arguments for the trunk (and for its export's ``model_args``).
    ``dynamic_img_size`` changes no key; it lets the network take other sides than ``img_size``."""
    patch, size = vit_geometry(name, settings)
    return {"num_classes": 0, "img_size": size, "patch_size": patch, "global_pool": settings.pool or "token",
            "dynamic_img_size": True}


def build_vit(name: str, settings: TrunkSettings) -> Trunk:
    import timm  # here, not at the top: only ViT jobs pay for importing it

    network = timm.create_model(name, pretrained=False, **vit_model_args(name, settings))
    return Trunk(network, network.num_features)


def vit_library_network(name: str, settings: TrunkSettings) -> LibraryNetwork:
    """``build_vit``'s call as timm code (the names and shapes are timm's own: with ``global_pool="avg"``
    the final norm is ``fc_norm``)."""
    args = vit_model_args(name, settings)
    # strings in double quotes (the card's style), numbers and booleans as Python writes them
    call = ", ".join(f"{key}={json.dumps(value) if isinstance(value, str) else repr(value)}"
                     for key, value in args.items())
    code = f"network = timm.create_model(\n    {json.dumps(name)}, pretrained=False,\n    {call},\n)"
    return LibraryNetwork(library="timm", architecture=name, imports=("import timm",), code=(code,), model_args=args)


def vit_blocks(network: nn.Module) -> list[nn.Module]:
    return list(network.blocks)


def check_vit(name: str, settings: TrunkSettings) -> None:
    for field in ("img_size", "patch_size"):
        value = getattr(settings, field)
        if value is not None and value < 1:
            raise ValueError(f"{field}={value} is invalid: use a positive number of pixels, or leave it unset for "
                             f"{name}'s own ({dict(zip(('patch_size', 'img_size'), VITS[name]))[field]})")
    if settings.pool is not None and settings.pool not in POOLS:
        raise ValueError(f"pool={settings.pool!r} is invalid: use token (the class token, the default) or avg (the "
                         f"mean of the patch tokens)")
    patch, size = vit_geometry(name, settings)
    if size % patch:
        raise ValueError(f"patch_size={patch} is invalid for img_size={size}: the image side must be a multiple of "
                         f"the patch size (e.g. patch_size 4 or 8 at 32 px, 16 at 224 px)")


for _name in VITS:
    register_backbone(Backbone(name=_name, family="vit", build=partial(build_vit, _name),
                               options=frozenset({"img_size", "patch_size", "pool"}), check=partial(check_vit, _name),
                               blocks=vit_blocks, export=partial(vit_library_network, _name)))
