"""Collectives used by the sharded classifier, each a forward/backward pair where it carries grads.

A group of ``None`` means "this rank alone": every helper is then the identity, so the same code
runs in a single-process job, in the replicated (DDP) baseline and in DHP.

The same calls run on gloo (CPU) and NCCL (GPU); torch 2.14's gloo implements both the
single-tensor all-gather and reduce-scatter.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist


# torch 2.13 renamed the single-tensor collectives and deprecated the old names (a FutureWarning
# each call); older torch (2.11 on the GPU machines that checked this, docs/gpu-results.md) has only
# the old ones.  Same arguments, same semantics.
def _all_gather_single(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, tensor, group=group)


def _reduce_scatter_single(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, tensor, group=group)


Group = dist.ProcessGroup | None


class CommTimer:
    """Accumulates the time spent in collectives without forcing a GPU sync per call.

    On the CPU, wall time around each (blocking) gloo call.  On CUDA, a pair of events per call,
    resolved by ``drain()``, which the trainer calls on log steps only.
    """

    def __init__(self) -> None:
        self._seconds = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.calls = 0  # collectives measured so far (benchmarks compare counts per step)

    @contextmanager
    def measure(self, device: torch.device):
        self.calls += 1
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((start, end))
        else:
            begin = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - begin

    def drain(self) -> float:
        """Seconds measured since the last drain."""
        for start, end in self._pending:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000.0
        self._pending.clear()
        seconds, self._seconds = self._seconds, 0.0
        return seconds


@contextmanager
def _timed(timer: CommTimer | None, tensor: torch.Tensor):
    if timer is None:
        yield
    else:
        with timer.measure(tensor.device):
            yield


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp, group: Group, timer: CommTimer | None = None) -> torch.Tensor:
    """In-place all-reduce; the identity for a single-rank group."""
    if group is not None:
        with _timed(timer, tensor):
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def gather_rows(tensor: torch.Tensor, group: Group, timer: CommTimer | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order (no autograd).

    All ranks must pass the same shape: the data pipeline gives every rank the same local batch.
    """
    size = group_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    out = torch.empty((size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    with _timed(timer, tensor):
        _all_gather_single(out, tensor, group=group)
    return out


def reduce_scatter_rows(tensor: torch.Tensor, group: Group, timer: CommTimer | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group and return this rank's block of rows (no autograd)."""
    size = group_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    rows = tensor.shape[0] // size
    out = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    with _timed(timer, tensor):
        _reduce_scatter_single(out, tensor, group=group)
    return out


class _AllGatherRows(torch.autograd.Function):
    """Forward: all-gather rows from every rank of the group (concatenated in rank order).
    Backward: reduce-scatter the gradient, i.e. sum the contributions every rank computed for the
    gathered rows and hand each rank the block that belongs to its own input rows."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Group, timer: CommTimer | None) -> torch.Tensor:
        ctx.group, ctx.timer = group, timer
        return gather_rows(tensor, group, timer)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # NCCL and gloo sum in the tensor's dtype: a bf16 gradient summed over 64 ranks would be
        # rounded at every hop of the ring.  Summed in fp32 it is rounded once, back to the
        # features' dtype.  The features' gradient is [B, D] (a few MB), so twice the bytes cost
        # nothing next to the backbone's own gradient reduction.
        summed = reduce_scatter_rows(grad_output.float(), ctx.group, ctx.timer)
        return summed.to(grad_output.dtype), None, None


class _ScaleGrad(torch.autograd.Function):
    """Forward: identity.  Backward: multiply the gradient by a constant factor."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output * ctx.factor, None


def all_gather_rows_with_grad(tensor: torch.Tensor, group: Group, timer: CommTimer | None = None) -> torch.Tensor:
    """Differentiable all-gather along dim 0 (see ``_AllGatherRows``)."""
    if group_size(group) == 1:
        return tensor
    return _AllGatherRows.apply(tensor, group, timer)


def scale_grad(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity whose backward scales the gradient by ``factor`` (see ``_ScaleGrad``)."""
    if factor == 1:
        return tensor
    return _ScaleGrad.apply(tensor, factor)


def _padded_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows``: one shape on every rank for a collective."""
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


def gather_uneven_rows_to_rank0(tensor: torch.Tensor, group: Group, counts: list[int]) -> torch.Tensor | None:
    """Every rank's rows in rank order on the group's first rank only (None elsewhere): what one
    process needs when the others need nothing (the linear probe).  ``counts``: every rank's row
    count, known to all (padding to the largest keeps one shape for the collective)."""
    if group_size(group) == 1:
        return tensor
    padded = _padded_rows(tensor, max(counts))
    first = dist.get_global_rank(group, 0) if group is not None else 0
    receiving = dist.get_rank() == first
    pieces = [torch.empty_like(padded) for _ in counts] if receiving else None
    dist.gather(padded, pieces, dst=first, group=group)
    if not receiving:
        return None
    return torch.cat([piece[:count] for piece, count in zip(pieces, counts)])


def object_from_rank0(value, group: Group):
    """``value`` as the group's first rank holds it, on every rank (a small picklable result that
    one rank computed before the others got here).  ``group``: a CPU (gloo) group, e.g. the control
    group.  The others wait in a collective, within its timeout: rank-0 work that may take longer (a
    linear probe's fits) goes through ``rank0_work.run_on_rank0``."""
    if group is None or dist.get_world_size(group) == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return holder[0]
