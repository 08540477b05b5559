"""Every place the code makes the host wait for the device, found by running it on fake CUDA
tensors (no GPU needed: a CUDA build of torch creates fake ``cuda`` tensors under
``FakeTensorMode``, shapes and devices propagate, nothing is computed).

On a real GPU the CPU runs ahead of the device, queueing kernels; these stop it:

- a copy from host memory into a device tensor (``copy_`` from a CPU tensor, ``to("cuda")`` of a
  CPU tensor, ``torch.tensor(..., device="cuda")``, an element assignment from a Python number):
  from pageable memory the copy is synchronous;
- reading a device value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``: the op
  ``_local_scalar_dense``), a copy from the device to the host, and ops whose output size depends on
  the data (``nonzero``, ``unique``, boolean-mask indexing), which wait for the device to know it.

``HostSyncRecorder`` records each one with the source line that asked for it (the first frame
outside torch and this module).  Under fake tensors a value read raises PyTorch's
``DataDependentOutputException`` after it is recorded: there is no value to return.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_TORCH_ROOT = str(Path(torch.__file__).parent)
_THIS_FILE = str(Path(__file__))
# Ops whose output size depends on the values: the host waits for the device to learn it.
_DATA_DEPENDENT = {"aten.nonzero.default", "aten.unique.default", "aten._unique2.default",
                   "aten.unique_consecutive.default", "aten.masked_select.default", "aten.unique_dim.default"}


@dataclass(frozen=True)
class HostSync:
    kind: str  # "host to device", "device to host" or "data-dependent size"
    op: str
    where: str  # "path:line in function" of the code that asked for it

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.where}"


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if not frame.filename.startswith(_TORCH_ROOT) and frame.filename != _THIS_FILE:
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "?"


def _is_cuda(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _is_host(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu"


def classify(func, args, kwargs) -> str | None:
    """What kind of host sync ``func(*args, **kwargs)`` is, or None."""
    name = str(func)
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if name == "aten._local_scalar_dense.default" and any(_is_cuda(t) for t in tensors):
        return "device to host"
    if name in _DATA_DEPENDENT and any(_is_cuda(t) for t in tensors):
        return "data-dependent size"
    if name == "aten.index.Tensor" and _is_cuda(args[0]) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
        return "data-dependent size"
    if name in ("aten.copy_.default", "aten.copy.default") and len(args) >= 2:
        destination, source = args[0], args[1]
        # a 0-d CPU tensor written into a device tensor still goes through host memory
        if _is_cuda(destination) and _is_host(source):
            return "host to device"
        if _is_host(destination) and _is_cuda(source):
            return "device to host"
    if name == "aten._to_copy.default" and args:
        target = kwargs.get("device")
        target = torch.device(target) if target is not None else args[0].device
        if _is_host(args[0]) and target.type == "cuda":
            return "host to device"
        if _is_cuda(args[0]) and target.type == "cpu":
            return "device to host"
    return None


class HostSyncRecorder(TorchDispatchMode):
    """``with FakeTensorMode(), HostSyncRecorder() as recorder: ...`` then ``recorder.syncs``."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[HostSync] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = classify(func, args, kwargs)
        if kind is not None:
            self.syncs.append(HostSync(kind, str(func), _caller()))
        return func(*args, **kwargs)
