"""Whole-tensor norms of weights and gradients when a rank holds only pieces of the tensors.

For one ``FlatPartition`` (``partitions.py``): each rank sums |w|^2 and |g|^2 over its pieces of
each row (tensor), one all-reduce of the [rows, 2] sums over the partition's process group makes
them whole on every rank, and ``per_element`` spreads any per-row value back over the flat tensor.
All of it stays on the device: the all-reduce is the only communication and nothing is read on
the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.optim.partitions import FlatPartition


def _indices(partition: FlatPartition, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each fragment [fragments], row of each element [numel]), built once per device.

    Elements in no fragment (ZeRO's alignment and last-rank padding) belong to row ``len(params)``,
    a spare row whose values ``per_element`` callers choose (scale 1, decay 0: padding stays 0)."""
    key = ("indices", device)
    if key not in partition.cache:
        spare = len(partition.params)
        index_dtype = torch.int32 if partition.tensor.numel() < 2**31 else torch.int64
        owner = torch.full((partition.tensor.numel(),), spare, dtype=index_dtype, device=device)
        for fragment in partition.fragments:
            owner[fragment.start:fragment.start + fragment.numel] = fragment.row
        rows = torch.tensor([f.row for f in partition.fragments], dtype=torch.long, device=device)
        partition.cache[key] = (rows, owner)
    return partition.cache[key]


def squared_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[len(tensors)] squared L2 norms, in fp32 or wider (one foreach kernel on a GPU)."""
    if not tensors:
        return torch.zeros(0)
    return torch.stack(torch._foreach_norm(tensors)).float().square()


def whole_squared_norms(partition: FlatPartition, weights: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """[rows, 2]: |w|^2 and |g|^2 of each whole row tensor, from every rank's pieces (collective
    over ``partition.process_group``; every rank of it calls this for the partition)."""
    device = weights.device
    rows, _ = _indices(partition, device)
    sums = torch.zeros(len(partition.params), 2, dtype=torch.float32, device=device)
    if partition.fragments:
        pieces = [(f.start, f.numel) for f in partition.fragments]
        local = torch.stack([squared_norms([weights.narrow(0, s, n) for s, n in pieces]),
                             squared_norms([grads.narrow(0, s, n) for s, n in pieces])], dim=1)
        sums.index_put_((rows,), local, accumulate=True)
    group = partition.process_group
    if group is not None and dist.is_initialized() and dist.get_world_size(group=group) > 1:
        dist.all_reduce(sums, group=group)
    return sums


def per_element(partition: FlatPartition, per_row: torch.Tensor, spare: float) -> torch.Tensor:
    """[numel] of the flat tensor: each element gets its row's value of ``per_row`` [rows]; elements
    of no row get ``spare``."""
    _, owner = _indices(partition, per_row.device)
    extended = torch.cat([per_row, per_row.new_full((1,), spare)])
    return extended.index_select(0, owner)
