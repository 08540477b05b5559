"""The exported tensors: the checkpoint's trunk under the library network's own names, and its head.

The names are checked against the library network itself, built on the meta device (no memory, no
init), so an export whose weights would not load with ``strict=True`` is refused before it is written.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.models.backbones.registry import LibraryNetwork

BACKBONE_PREFIX = "backbone."
HEAD_PREFIX = "head."


def _without_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix):]: tensor for name, tensor in state.items() if name.startswith(prefix)}


def first_difference(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str | None:
    """The first name (in ``expected``'s order, then ``found``'s extras) whose presence or shape differs."""
    for name, tensor in expected.items():
        if name not in found:
            return f"{name!r} is missing from the checkpoint"
        if tuple(found[name].shape) != tuple(tensor.shape):
            return f"{name!r} is {tuple(found[name].shape)} in the checkpoint and {tuple(tensor.shape)} in the library"
    extra = next((name for name in found if name not in expected), None)
    return None if extra is None else f"{extra!r} is in the checkpoint and not in the library network"


def export_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Floating tensors as contiguous fp32 (the checkpoint's master weights already are); integer
    buffers (BatchNorm's ``num_batches_tracked``) keep their type."""
    tensor = tensor.detach()
    if tensor.is_floating_point():
        tensor = tensor.to(torch.float32)
    return tensor.contiguous()


def library_state_dict(model_state: dict[str, torch.Tensor], library: LibraryNetwork,
                       arch: str) -> dict[str, torch.Tensor]:
    """The trunk's tensors of an instcls state dict (``backbone.*``) under the library network's
    names, in its order.  Raises ``ValueError`` naming the first differing name."""
    with torch.device("meta"):
        expected = library.build().state_dict()
    trunk = _without_prefix(model_state, BACKBONE_PREFIX)
    problem = first_difference(trunk, expected)
    if problem is not None:
        raise ValueError(f"the checkpoint's backbone does not match {library.library}'s {library.architecture} "
                         f"(model.arch={arch}): {problem}. Export it with the config it was trained with "
                         "(--config/--set: model.arch, small_input_stem, img_size, patch_size, pool)")
    return {name: export_tensor(trunk[name]) for name in expected}


def head_state_dict(model_state: dict[str, torch.Tensor], head: nn.Module) -> dict[str, torch.Tensor]:
    """The projection head's tensors (``head.*``) under the names of ``head`` (instcls's module, for
    its names and shapes only: it may live on the meta device)."""
    expected = head.state_dict()
    found = _without_prefix(model_state, HEAD_PREFIX)
    problem = first_difference(found, expected)
    if problem is not None:
        raise ValueError(f"the checkpoint's head does not match model.head: {problem}. Export it with the config "
                         "it was trained with (model.head, head_hidden_dim, feature_dim), or without --with-head")
    return {name: export_tensor(found[name]) for name in expected}
