"""The export's ``config.json``: timm's hub layout (``architecture``, ``num_features``, ``model_args``,
``pretrained_cfg`` with the input size, mean and std) for ViTs, so that
``timm.create_model("local-dir:EXPORT", pretrained=True)`` builds and loads it offline, and instcls's
own ``instcls`` section for every family (what the trunk is and what its inputs are)."""

from __future__ import annotations

from dataclasses import dataclass

from data_pipeline.contract import IMAGENET_MEAN, IMAGENET_STD
from trainer.models.backbones.registry import LibraryNetwork


@dataclass(frozen=True)
class InputSpec:
    """What the network was trained on: ``size`` x ``size`` RGB crops in [0, 1], normalised with
    ``mean`` and ``std``; instcls's evaluation resizes the shorter side to ``resize`` pixels
    (bilinear, antialiased) and centre-crops ``size``."""

    size: int
    resize: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @property
    def crop_pct(self) -> float:  # timm's name for size / resize
        return round(self.size / self.resize, 4)


def input_spec(config) -> InputSpec:
    """The job's training view size (``data.loader.augment.image_size``) and the loaders' normalisation."""
    augment = config.data.loader.augment
    return InputSpec(size=augment.image_size, resize=round(augment.image_size * augment.eval_resize),
                     mean=tuple(IMAGENET_MEAN), std=tuple(IMAGENET_STD))


def head_description(model_config, width: int) -> dict[str, object]:
    """``head.safetensors``'s module: its layers and widths (``model.head``)."""
    if model_config.head == "linear":
        return {"kind": "linear", "layers": ["Linear"], "in_features": width, "out_features": model_config.feature_dim}
    return {"kind": "mlp", "layers": ["Linear", "BatchNorm1d", "ReLU", "Linear"], "in_features": width,
            "hidden_features": model_config.head_hidden_dim, "out_features": model_config.feature_dim}


def export_config(config, library: LibraryNetwork, width: int, checkpoint: dict | None = None,
                  with_head: bool = False) -> dict[str, object]:
    """``config.json`` of an export of ``config``'s trunk (``width``: its feature width);
    ``checkpoint``: ``{path, global_step, epoch}`` of the weights, for the record."""
    spec, model = input_spec(config), config.model
    instcls: dict[str, object] = {
        "arch": model.arch, "library": library.library, "architecture": library.architecture,
        "small_input_stem": model.small_input_stem, "img_size": model.img_size, "patch_size": model.patch_size,
        "pool": model.pool, "input_norm": model.input_norm, "width": width,
        "input_size": [3, spec.size, spec.size], "resize": spec.resize, "interpolation": "bilinear",
        "mean": list(spec.mean), "std": list(spec.std), "checkpoint": checkpoint,
    }
    if with_head:
        instcls["head"] = {"file": "head.safetensors", **head_description(model, width)}
    exported: dict[str, object] = {"architecture": library.architecture, "num_classes": 0, "num_features": width}
    if library.library == "timm":
        exported["global_pool"] = library.model_args.get("global_pool", "token")
        exported["model_args"] = dict(library.model_args)
        exported["pretrained_cfg"] = {
            "input_size": [3, spec.size, spec.size], "fixed_input_size": False, "interpolation": "bilinear",
            "crop_pct": spec.crop_pct, "crop_mode": "center", "mean": list(spec.mean), "std": list(spec.std),
            "num_classes": 0, "first_conv": "patch_embed.proj", "classifier": "head",
        }
    exported["instcls"] = instcls
    return exported
