"""Activation checkpointing of residual units (``model.activation_checkpointing``).

A checkpointed unit keeps only its input for the backward: its forward runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, which saves nothing of the unit's
inside and re-runs the unit's forward when the backward first needs one of its tensors.  Only
training-mode forwards that record a graph are checkpointed; evaluation and ``no_grad`` passes (the
contrastive prior's, kNN features) run the unit as it is.

The units are whatever the registry entry's ``blocks(trunk)`` lists, whatever the family.  Each
keeps its module object and its class's behaviour: its class becomes a subclass that only reroutes
``forward`` (as ``trainer.models.batch_norm_precision`` does for BatchNorm), so parameter and
state-dict names do not change and a checkpoint saved with checkpointing off loads with it on and
back.

Buffers.  The recomputation is a second training-mode forward of the unit, and a training-mode
BatchNorm updates its running statistics in every forward: left alone, each step would move
``running_mean``/``running_var`` twice and count two batches in ``num_batches_tracked``.  So the
recomputation runs with every buffer of the unit swapped for a scratch copy, and the unit's own
buffers are put back untouched when it ends (also when torch stops it early, having recomputed what
the backward needed).  The copies are the size of the buffers (2 x C per BatchNorm), and the
originals are never written in place during the backward, so nothing autograd saved in the first
forward changes version.  The output does not depend on the running statistics in training mode,
so the recomputed tensors equal the first forward's.

Under ``model.compile`` dynamo turns each checkpoint into a region of the joint graph that the
partitioner recomputes; it takes no ``context_fn`` (it raises on one), and needs none: the compiled
forward applies buffer updates once, and the backward graph recomputes without repeating them.

The unit's own forward hooks do not run in the recomputation (its submodules' do).  ZeRO-3 gathers a
module's own parameters in its hooks, so a unit must hold its parameters in submodules:
``checkpoint_units`` refuses one that does not (ResNet blocks and timm's ViT blocks do not).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def _scratch_buffers(unit: nn.Module) -> Iterator[None]:
    """Within: every buffer of ``unit`` (and of its submodules) is a copy; after: the originals."""
    originals = []
    for module in unit.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                originals.append((module, name, buffer))
    for module, name, buffer in originals:
        module._buffers[name] = buffer.clone()
    try:
        yield
    finally:
        for module, name, buffer in originals:
            module._buffers[name] = buffer


class CheckpointedUnit:
    """Mixed in before a unit's own class: ``forward`` runs the class's forward under a
    non-reentrant checkpoint in training mode with grad enabled, and directly otherwise."""

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return super().forward(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Compiled, the checkpoint is a region of the joint graph that the partitioner recomputes:
            # buffer updates are applied once, in the forward, and dynamo takes no context_fn.
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)
        contexts = lambda: (contextlib.nullcontext(), _scratch_buffers(self))  # noqa: E731
        return checkpoint(super().forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


_CHECKPOINTED_CLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if issubclass(cls, CheckpointedUnit):
        return cls
    if cls not in _CHECKPOINTED_CLASSES:
        _CHECKPOINTED_CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (CheckpointedUnit, cls),
                                          {"__module__": __name__})
    return _CHECKPOINTED_CLASSES[cls]


def checkpoint_units(units: Sequence[nn.Module]) -> None:
    """Every module of ``units`` in place runs checkpointed (same object, state and names)."""
    for unit in units:
        own = [name for name, _ in unit.named_parameters(recurse=False)]
        if own:
            raise ValueError(f"{type(unit).__name__} holds parameters {own} itself: the recomputation skips a "
                             "unit's own hooks (ZeRO-3 gathers parameters there); list units whose parameters "
                             "live in submodules in the registry entry's blocks")
        unit.__class__ = _checkpointed_class(type(unit))
