"""Where each module parameter's fp32 master and optimizer state live on this rank, under DeepSpeed.

The torch optimizer that DeepSpeed wraps steps tensors of DeepSpeed's making, not the module's:

- stage 0 in fp32: the module's parameters themselves (no partitions: ``optimizer_partitions`` is
  empty);
- stage 0 in bf16 (``FP16_UnfusedOptimizer``): one fp32 copy per parameter (``fp32_groups``);
- ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and stage 1 with fp32 gradients (``BF16_Optimizer``): per
  param group, the group's parameters flattened and cut into equal pieces, one per rank, with no
  regard to tensor boundaries, so a tensor may straddle two or more ranks.  This rank's piece is
  one flat fp32 tensor; DeepSpeed records each parameter's share of it in
  ``param._hp_mapping.hp_fragment_address`` (start, numel), None where this rank holds none;
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): per sub-group one flat fp32 tensor, the concatenation
  of each parameter's own partition: ``param.partition_numel()`` elements (numel / ranks, rounded
  up), rank r's starting at element r * partition_numel of the flattened tensor, zero-padded past
  its end.

``optimizer_partitions`` describes all of these alike, as ``FlatPartition``s: the tensor the torch
optimizer steps, the module parameters (rows) it holds pieces of, and each piece (``Fragment``).
LARS reads it to sum each whole tensor's norm over the ranks; the checkpoint reads it to find the
tensor whose state is a parameter's.  It reads DeepSpeed's attributes only (DeepSpeed 0.19), so it
needs no DeepSpeed import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class Fragment:
    """A piece of row ``row``'s parameter: elements ``start .. start + numel`` of the flat tensor."""

    row: int
    start: int
    numel: int


@dataclass(eq=False)
class FlatPartition:
    """Attributes:
    tensor: what the torch optimizer steps (and keys its state by) on this rank.
    params: the module parameters it holds pieces of, in an order every rank shares (the rows).
    fragments: this rank's pieces, each of one row; rows without a piece here are absent.
    group_index: the torch optimizer's param group of ``tensor`` (its hyperparameters).
    process_group: the ranks holding the other pieces of the rows (None: every piece is whole).
    cache: index tensors built from the fragments once, by whoever needs them (LARS).
    """

    tensor: torch.Tensor
    params: list[nn.Parameter]
    fragments: list[Fragment]
    group_index: int
    process_group: object | None = None
    cache: dict = field(default_factory=dict)


def _zero_1_2(params_by_group, flats, process_groups) -> list[FlatPartition]:
    partitions = []
    for index, (params, flat) in enumerate(zip(params_by_group, flats)):
        fragments = []
        for row, param in enumerate(params):
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is not None and mapping.hp_fragment_address.numel > 0:
                address = mapping.hp_fragment_address
                fragments.append(Fragment(row, int(address.start), int(address.numel)))
        partitions.append(FlatPartition(flat, list(params), fragments, index, process_groups[index]))
    return partitions


def _zero_3(optimizer) -> list[FlatPartition]:
    partitions = []
    for sub_group, (params, flat) in enumerate(zip(optimizer.fp16_groups, optimizer.fp32_partitioned_groups_flat)):
        process_group = optimizer.sub_group_process_groups[sub_group]
        rank = torch.distributed.get_rank(group=process_group)
        fragments, offset = [], 0
        for row, param in enumerate(params):
            size = param.partition_numel()
            valid = max(0, min(size, param.ds_numel - rank * size))  # the last ranks' pieces are padding
            if valid:
                fragments.append(Fragment(row, offset, valid))
            offset += size
        partitions.append(FlatPartition(flat, list(params), fragments, optimizer.sub_group_to_group_id[sub_group],
                                        process_group))
    return partitions


def _whole_copies(optimizer) -> list[FlatPartition]:
    return [FlatPartition(copy, [param], [Fragment(0, 0, copy.numel())], index)
            for index, (params, copies) in enumerate(zip(optimizer.fp16_groups, optimizer.fp32_groups))
            for param, copy in zip(params, copies)]


def optimizer_partitions(optimizer) -> list[FlatPartition]:
    """The tensors DeepSpeed's ``optimizer`` (``engine.optimizer``) has its torch optimizer step, as
    ``FlatPartition``s; ``[]`` for a plain torch optimizer (stage 0 in fp32: whole parameters)."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3
        return _zero_3(optimizer)
    if hasattr(optimizer, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        return _zero_1_2(optimizer.bit16_groups, optimizer.single_partition_of_fp32_groups,
                         optimizer.real_dp_process_group)
    if hasattr(optimizer, "fp32_groups_flat_partition"):  # BF16_Optimizer
        return _zero_1_2(optimizer.bf16_groups, optimizer.fp32_groups_flat_partition, optimizer.real_dp_process_group)
    if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):  # stage 0, bf16
        return _whole_copies(optimizer)
    return []


def stepped_tensors(optimizer) -> list[tuple[torch.Tensor, dict]]:
    """``(tensor, its param group)`` for every tensor the torch optimizer inside ``optimizer`` steps
    (DeepSpeed's fp32 copies or partitions, else the parameters)."""
    base = getattr(optimizer, "optimizer", optimizer)
    partitions = optimizer_partitions(optimizer)
    if partitions:
        return [(partition.tensor, base.param_groups[partition.group_index]) for partition in partitions]
    return [(param, group) for group in base.param_groups for param in group["params"]]


def create_initial_state(optimizer) -> bool:
    """Creates, through the torch optimizer's ``initial_state(tensor, group)``, the state its first
    step would create, for every tensor it steps; False when it has no ``initial_state``.

    DeepSpeed's ZeRO-1/2 steps one param group at a time and, after the first, maps every group's
    state onto the parameters' fragments once (``_lazy_init_hp_params_optimizer_state``): a group
    not stepped yet has no state then and its parameters never get their state mapped, so a
    checkpoint could not read it.  With the state there from the start every group is mapped."""
    base = getattr(optimizer, "optimizer", optimizer)
    initial_state = getattr(base, "initial_state", None)
    if initial_state is None:
        return False
    for tensor, group in stepped_tensors(optimizer):
        state = base.state[tensor]
        for key, value in initial_state(tensor, group).items():
            state.setdefault(key, value)
    return True


def state_owners(optimizer, partitions: list[FlatPartition] | None = None) -> dict[nn.Parameter, torch.Tensor]:
    """``{module parameter: the tensor whose optimizer state is (or holds) its state on this rank}``:
    the parameter itself at stage 0 in fp32, else its fp32 copy or its group's flat partition (every
    rank has one per group, with or without a piece of the parameter)."""
    if partitions is None:
        partitions = optimizer_partitions(optimizer)
    if not partitions:
        base = getattr(optimizer, "optimizer", optimizer)
        return {param: param for group in base.param_groups for param in group["params"]}
    return {param: partition.tensor for partition in partitions for param in partition.params}
