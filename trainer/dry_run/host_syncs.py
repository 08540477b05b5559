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
outside torch and this package).  Under fake tensors a value read raises PyTorch's
``DataDependentOutputException`` after it is recorded: there is no value to return.  With
``assume_values=True`` (the dry run) the step goes on instead: a value read returns 1 (True), and
an output sized by the data takes its largest size (every mask element true), so the rest of the
step still runs and its memory is an upper bound.
"""

from __future__ import annotations

import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_TORCH_ROOT = str(Path(torch.__file__).parent)
_DRY_RUN_PACKAGE = str(Path(__file__).parent)
_PROJECT_ROOT = str(Path(__file__).parents[2]) + "/"  # where trainer/ and data_pipeline/ are


def where(filename: str, line: int, function: str) -> str:
    """``path:line in function``, the path relative to the project when it is the project's."""
    return f"{filename.removeprefix(_PROJECT_ROOT)}:{line} in {function}"
# Ops whose output size depends on the values: the host waits for the device to learn it.
_DATA_DEPENDENT = {"aten.nonzero.default", "aten.unique.default", "aten._unique2.default",
                   "aten.unique_consecutive.default", "aten.masked_select.default", "aten.unique_dim.default",
                   "aten.bincount.default"}  # bincount's length is max(minlength, largest value + 1)


@dataclass(frozen=True)
class HostSync:
    kind: str  # "host to device", "device to host" or "data-dependent size"
    op: str
    where: str  # "path:line in function" of the code that asked for it
    background: bool = False  # made by a task for a worker thread: it waits, the training thread does not

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.where}{' (in a worker thread)' if self.background else ''}"


def innermost_project_frame(frames, also_skip: tuple[str, ...] = ()) -> str:
    """``path:line in function`` of the innermost of ``frames`` outside torch, the dry run itself and
    ``also_skip`` ("?" if none)."""
    for frame in reversed(frames):
        if not frame.filename.startswith((_TORCH_ROOT, _DRY_RUN_PACKAGE, *also_skip)):
            return where(frame.filename, frame.lineno, frame.name)
    return "?"


def caller(also_skip: tuple[str, ...] = ()) -> str:
    """Where the code that is running now was asked for (see ``innermost_project_frame``)."""
    return innermost_project_frame(traceback.extract_stack()[:-1], also_skip)


def _is_cuda(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _is_host(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu"


PINNED = "_dry_run_pinned"  # set on host tensors in page-locked memory (``fake_cuda`` marks them)


def _asynchronous(host: torch.Tensor, non_blocking) -> bool:
    """A copy between pinned host memory and the device with ``non_blocking`` does not wait."""
    return bool(non_blocking) and getattr(host, PINNED, False)


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
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        # a 0-d CPU tensor written into a device tensor still goes through host memory
        if _is_cuda(destination) and _is_host(source) and not _asynchronous(source, non_blocking):
            return "host to device"
        if _is_host(destination) and _is_cuda(source) and not _asynchronous(destination, non_blocking):
            return "device to host"
    if name == "aten._to_copy.default" and args:
        target = kwargs.get("device")
        target = torch.device(target) if target is not None else args[0].device
        if _is_host(args[0]) and target.type == "cuda" and not _asynchronous(args[0], kwargs.get("non_blocking")):
            return "host to device"
        # to("cpu", non_blocking=True) lands in pinned memory; the host then waits on an event (recorded apart)
        if _is_cuda(args[0]) and target.type == "cpu" and not kwargs.get("non_blocking"):
            return "device to host"
    return None


def _assumed(func, args, kwargs):
    """What a data-dependent op returns in the dry run: its value assumed 1, its size the largest."""
    name = str(func)
    if name == "aten._local_scalar_dense.default":
        return True if args[0].dtype == torch.bool else 1 if not args[0].is_floating_point() else 1.0
    if name == "aten.nonzero.default":
        return torch.empty((args[0].numel(), args[0].dim()), dtype=torch.int64, device=args[0].device)
    if name == "aten.index.Tensor":
        indices = [torch.arange(i.numel(), device=i.device).view(i.shape) if isinstance(i, torch.Tensor)
                   and i.dtype == torch.bool and i.dim() == 1 else i for i in args[1]]
        if all(not isinstance(i, torch.Tensor) or i.dtype != torch.bool for i in indices):
            return func(args[0], indices)
    if name == "aten.bincount.default":  # assumed: no value reaches minlength
        minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
        dtype = torch.int64 if (args[1] if len(args) > 1 else kwargs.get("weights")) is None else torch.float64
        return torch.zeros(max(minlength, 1), dtype=dtype, device=args[0].device)
    if name == "aten.masked_select.default":
        return torch.empty(args[1].numel(), dtype=args[0].dtype, device=args[0].device)
    return NotImplemented


class HostSyncRecorder(TorchDispatchMode):
    """``with FakeTensorMode(), HostSyncRecorder() as recorder: ...`` then ``recorder.syncs``."""

    def __init__(self, assume_values: bool = False) -> None:
        super().__init__()
        self.syncs: list[HostSync] = []
        self.assume_values = assume_values
        self.in_worker_task = 0  # > 0 while a thread pool's task runs inline (``fake_cuda``)

    def note(self, kind: str, op: str) -> None:
        """Record a sync that is not an op (``torch.cuda.synchronize``, an event's wait on the host)."""
        self.syncs.append(HostSync(kind, op, caller(), self.in_worker_task > 0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = classify(func, args, kwargs)
        if kind is not None:
            self.note(kind, str(func))
            if self.assume_values and kind != "host to device":
                assumed = _assumed(func, args, kwargs)
                if assumed is not NotImplemented:
                    return assumed
        out = func(*args, **kwargs)
        if kwargs.get("pin_memory") and isinstance(out, torch.Tensor):
            setattr(out, PINNED, True)
        return out


@contextmanager
def device_sync_sites():
    """On a real GPU: CUDA's own sync debug mode over the block, each synchronizing call recorded, as
    it warns, with the innermost source line outside torch that asked for it (the project's, or a
    library's such as DeepSpeed's).  Only the thread that entered the block counts: the warnings hook
    is process-wide, and a worker thread that waits on its own stream (PIC's prefetch) does not stall
    the training thread.  The mode does not report ``torch.cuda.synchronize`` or a stream's or an
    event's ``synchronize``: ``device_waits`` counts those.  Yields the list the sites are appended to."""
    import threading

    import torch

    sites: list[str] = []
    training_thread = threading.get_ident()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message).lower() and threading.get_ident() == training_thread:
            sites.append(caller(also_skip=(warnings.__file__,)))  # the frames that deliver the warning

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # called where the warning is raised: the stack is the sync's
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
