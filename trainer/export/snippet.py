"""The model card's Python: plain torch + the library + safetensors, never instcls.  It rebuilds the
network from the registry entry's own lines (``LibraryNetwork.code``), loads ``model.safetensors``
with ``strict=True`` and defines ``embed(images)``, which normalises as the training loader did
(and standardises each image first when the run used ``model.input_norm: per_image``)."""

from __future__ import annotations

from trainer.export.export_config import InputSpec
from trainer.models.backbones.registry import LibraryNetwork


def _floats(values) -> str:
    return "[" + ", ".join(repr(float(value)) for value in values) + "]"


def usage_snippet(library: LibraryNetwork, spec: InputSpec, input_norm: str, width: int) -> str:
    """Python that loads the export (run from the export folder) and defines ``embed``."""
    imports = ["import torch", *(line for line in library.imports if line != "import torch"),
               "from safetensors.torch import load_file"]
    body = [
        *library.code,
        'network.load_state_dict(load_file("model.safetensors"), strict=True)  # the file beside this card',
        "network.eval()",
        "",
        f"MEAN = torch.tensor({_floats(spec.mean)}).view(3, 1, 1)",
        f"STD = torch.tensor({_floats(spec.std)}).view(3, 1, 1)",
        "",
        "",
        "@torch.no_grad()",
        "def embed(images: torch.Tensor) -> torch.Tensor:",
        f'    """RGB images in [0, 1], [b, 3, {spec.size}, {spec.size}] -> features [b, {width}]."""',
        "    images = (images - MEAN) / STD  # the ImageNet mean and std instcls's loaders normalise with",
    ]
    if input_norm == "per_image":
        body.append("    images = torch.nn.functional.instance_norm(images)  # each image's channels to mean 0, "
                    "variance 1, as in training")
    body.append("    return network(images)")
    return "\n".join([*imports, "", *body]) + "\n"


def head_snippet(description: dict) -> str:
    """Python (after ``usage_snippet``) that builds the projection head and loads ``head.safetensors``."""
    if description["kind"] == "linear":
        build = f"head = torch.nn.Linear({description['in_features']}, {description['out_features']})"
    else:
        hidden = description["hidden_features"]
        build = (f"head = torch.nn.Sequential(torch.nn.Linear({description['in_features']}, {hidden}), "
                 f"torch.nn.BatchNorm1d({hidden}), torch.nn.ReLU(),\n"
                 f"                           torch.nn.Linear({hidden}, {description['out_features']}))")
    return "\n".join([build, 'head.load_state_dict(load_file("head.safetensors"), strict=True)', "head.eval()",
                      "# projections = head(embed(images))  # what the instance classifier was trained on"]) + "\n"
