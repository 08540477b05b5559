"""Where the student's fp32 weights live, for the momentum teacher's update: DeepSpeed's master copy.

Under a bf16 config the module's parameters are bf16 copies rounded from fp32 masters at every step;
a teacher moved from them would carry that rounding, and a bf16 teacher at momentum 0.999 would not
move at all (the step is below half a bf16 ulp).  So the teacher (fp32) is moved from the tensor the
optimizer steps, which by DeepSpeed 0.19 setup is:

- ZeRO-0 in fp32 or under ``torch_autocast`` (``zero0``, ``zero0_autocast_bf16``): the job's own
  optimizer, unwrapped; each module parameter is fp32 and is the master itself.
- ZeRO-0 with bf16 (``zero0_bf16``): DeepSpeed wraps the job's optimizer (torch's or ``trainer.optim``'s)
  in ``FP16_UnfusedOptimizer`` in bf16 mode; the master of module parameter
  ``optimizer.fp16_groups[i][j]`` is ``optimizer.fp32_groups[i][j]``, whole on every rank.  (With
  DeepSpeed's own FusedAdam it builds ``FP16_Optimizer`` instead: the parameters are views into
  ``optimizer.fp16_groups_flat[i]`` and the master is ``optimizer.fp32_groups_flat[i]``.)
- ZeRO-1/2 (``zero1``, ``zero2``, ``zero2_bf16``): ``DeepSpeedZeroOptimizer``; the parameters are views
  into ``optimizer.bit16_groups_flat[i]``, cut into equal partitions over the data-parallel group, and
  this rank's fp32 master is ``optimizer.single_partition_of_fp32_groups[i]``, the master of
  ``optimizer.parallel_partitioned_bit16_groups[i][rank]``.
- ZeRO-1 with bf16 and fp32 gradient accumulation (``zero1_bf16``): ``BF16_Optimizer``;
  ``optimizer.bf16_groups_flat[i]``, this rank's ``optimizer.fp32_groups_flat_partition[i]`` of
  ``optimizer.bf16_partitioned_groups[i][rank]``.
- ZeRO-3 is refused before the engine is built (``trainer.engine.teacher_setup``).

Each becomes a list of ``MasterGroup``: a flat buffer of the student's parameters, and the fp32 piece
of it this rank steps.  The teacher mirrors each flat buffer in fp32, moves the piece from the master
with no communication, and, where the pieces are partitions, all-gathers them, the way DeepSpeed
all-gathers the student's parameters after its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class MasterGroup:
    """``parameters``: the student's, laid out in ``flat`` (their ``data`` are views into it);
    ``master``: the fp32 tensor the optimizer steps for ``flat[start : start + master.numel()]`` on this
    rank; ``group``: the ranks whose pieces make up ``flat`` (None: the piece is the whole of it)."""

    parameters: list[torch.nn.Parameter]
    flat: torch.Tensor
    master: torch.Tensor
    start: int
    group: dist.ProcessGroup | None = None
    kind: str = "parameter"  # which of DeepSpeed's tensors ``master`` is, for messages

    def offset_of(self, parameter: torch.Tensor) -> int:
        """Where ``parameter``'s elements start in ``flat``."""
        if len(self.parameters) == 1 and self.flat.numel() == parameter.numel():
            return 0  # a flat buffer of one parameter: the parameter itself (the job's optimizer, unwrapped)
        offset, remainder = divmod(parameter.data_ptr() - self.flat.data_ptr(), self.flat.element_size())
        if remainder or not 0 <= offset <= self.flat.numel() - parameter.numel():
            raise RuntimeError(f"a parameter of shape {tuple(parameter.shape)} does not lie in the flat buffer of "
                               f"{self.kind}: DeepSpeed's layout is not the one trainer.engine.teacher_masters reads")
        return offset


def _element_offset(view: torch.Tensor, flat: torch.Tensor) -> int:
    return (view.data_ptr() - flat.data_ptr()) // flat.element_size()


def _partitioned(optimizer, parameters, flats, masters, partitions, kind: str) -> list[MasterGroup]:
    groups = []
    for i, flat in enumerate(flats):
        group = optimizer.real_dp_process_group[i]
        ranks, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        if flat.numel() % ranks:
            raise RuntimeError(f"{kind}[{i}] has {flat.numel()} elements, not a multiple of the {ranks} ranks it is "
                               "partitioned over: the teacher cannot line up with its partitions")
        master, piece = masters[i], partitions[i][rank]
        if master.numel() != piece.numel():
            raise RuntimeError(f"{kind}[{i}] holds {master.numel()} elements for a partition of {piece.numel()}")
        if master.device != flat.device:
            raise RuntimeError(f"{kind}[{i}] is on {master.device}, the parameters on {flat.device} (ZeRO-Offload): "
                               "a momentum teacher needs the master weights on the device; remove "
                               "zero_optimization.offload_optimizer from the DeepSpeed config")
        groups.append(MasterGroup(list(parameters[i]), flat, master, _element_offset(piece, flat),
                                  group if ranks > 1 else None, kind))
    return groups


def master_groups(engine) -> list[MasterGroup]:
    """The student's parameters and their fp32 masters on this rank, by the engine's setup (see the
    module docstring); ``RuntimeError`` for a setup that keeps no fp32 weight the teacher can read."""
    if engine.zero_optimization_stage() >= 3:
        raise RuntimeError("ZeRO-3 partitions the parameters themselves: refused by trainer.engine.teacher_setup")
    optimizer = engine.optimizer
    if hasattr(optimizer, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        return _partitioned(optimizer, optimizer.bit16_groups, optimizer.bit16_groups_flat,
                            optimizer.single_partition_of_fp32_groups, optimizer.parallel_partitioned_bit16_groups,
                            "single_partition_of_fp32_groups")
    if hasattr(optimizer, "fp32_groups_flat_partition"):  # BF16_Optimizer (ZeRO-1, bf16, fp32 accumulation)
        return _partitioned(optimizer, optimizer.bf16_groups, optimizer.bf16_groups_flat,
                            optimizer.fp32_groups_flat_partition, optimizer.bf16_partitioned_groups,
                            "fp32_groups_flat_partition")
    if hasattr(optimizer, "fp32_groups_flat") and hasattr(optimizer, "fp16_groups_flat"):  # ZeRO-0 bf16, FusedAdam
        return [MasterGroup(list(parameters), flat, master, 0, None, "fp32_groups_flat")
                for parameters, flat, master in zip(optimizer.fp16_groups, optimizer.fp16_groups_flat,
                                                    optimizer.fp32_groups_flat)]
    if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):  # ZeRO-0 bf16, the job's optimizer
        return [MasterGroup([parameter], parameter.data, master.detach().view(-1), 0, None, "fp32_groups")
                for parameters, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups)
                for parameter, master in zip(parameters, masters)]
    groups = []  # the job's optimizer, unwrapped: the parameters are the masters
    for name, parameter in engine.module.named_parameters():
        if not parameter.requires_grad:
            continue
        if parameter.dtype != torch.float32:
            raise RuntimeError(f"{name} is {parameter.dtype} and DeepSpeed keeps no fp32 master of it "
                               f"({type(optimizer).__name__}): a momentum teacher needs fp32 weights to move from")
        groups.append(MasterGroup([parameter], parameter.data, parameter.data.view(-1), 0, None))
    return groups
