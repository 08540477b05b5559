"""The registries' names that `instcls plan` offers as choices, written out here so that building the
parser imports no torch: the registries themselves (``trainer.models.backbones``, ``trainer.optim``)
load it with their entries.  tests/unit/test_cli_imports.py holds these equal to the registries, so
a new backbone or optimizer adds its name here as well."""

BACKBONE_NAMES = (
    "resnet10", "resnet18", "resnet34", "resnet50", "resnet101",
    "vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224",
    "vit_huge_patch14_224",
)  # ``backbone_names()``: registration order, family by family
OPTIMIZER_NAMES = ("adamw", "lars", "sgd")  # ``optimizer_names()``: sorted
