"""Ops whose result the host must wait for, caught on any device (real CPU tensors included, where
``trainer.dry_run.host_syncs`` looks at CUDA tensors only): value reads (``.item()``, ``float(t)``:
``aten._local_scalar_dense``) and outputs sized by the data (``nonzero``, boolean-mask indexing),
as PyTorch tags them (``data_dependent_output``, ``dynamic_output_shape``).  ``.tolist()`` of a CPU
tensor reads memory without an op and is not seen here; the fake-CUDA recorder refuses it."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


class DataDependentOps(TorchDispatchMode):
    """``with DataDependentOps() as found: ...`` then ``found.ops``: every such op, by name, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(tag in func.tags for tag in _TAGS):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
