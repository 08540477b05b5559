"""The job's side of an objective's teacher: refused where the setup cannot give one, else built.

An objective that asks for a teacher (``Objective.teacher_request``) gets one, a fp32 momentum copy of
the network (``trainer.engine.momentum_teacher``), under DeepSpeed ZeRO 0, 1 and 2.  Refused at start,
naming the field, before DeepSpeed starts:

- ZeRO-3 (``zero_optimization.stage`` of ``deepspeed_config``): the student's parameters exist only as
  partitions; a teacher that follows them needs a second DeepSpeed engine lined up with those
  partitions, which instcls does not build yet.  Use a stage 0-2 config (a ResNet-50's teacher costs
  100 MB per rank in fp32).
- ZeRO-Offload of the optimizer (``zero_optimization.offload_optimizer``): the fp32 masters the teacher
  moves from are then in host memory.
- views the loader does not make (a request for view 2 of a two-view job).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from trainer.config_building import ConfigError
from trainer.config_deepspeed import load_deepspeed_config
from trainer.engine.momentum_teacher import MomentumTeacher
from trainer.objectives import TeacherRequest
from trainer.parallel.batch_norm import apply_batch_norm_mode, statistics_differ_by_rank


def refuse_teacher_setup(request: TeacherRequest, objective_name: str, ds_config: dict, ds_path,
                         num_views: int) -> None:
    """``ConfigError`` naming the field when the job cannot keep the teacher ``request`` asks for."""
    zero = ds_config.get("zero_optimization", {})
    needs = f"objective.name={objective_name!r} needs a momentum teacher (a fp32 copy of the backbone and head)"
    if zero.get("stage", 0) >= 3:
        raise ConfigError(f"{needs}, which instcls keeps at ZeRO stages 0 to 2 only; deepspeed_config={ds_path} sets "
                          "zero_optimization.stage=3: use a stage 0-2 config (e.g. deepspeed_config=zero2_bf16)")
    offload = zero.get("offload_optimizer") or {}
    if offload.get("device", "none") not in ("none", None):
        raise ConfigError(f"{needs}, moved from the fp32 master weights on the device; deepspeed_config={ds_path} sets "
                          f"zero_optimization.offload_optimizer.device={offload['device']!r}, which keeps them in "
                          "host memory: remove zero_optimization.offload_optimizer")
    try:
        request.check_views(num_views)
    except ValueError as error:
        raise ConfigError(str(error)) from None


class TeacherSetup:
    """What the trainer keeps of a teacher between the network's construction and the engine's:
    ``of_job`` (refusals first), ``copy_network`` (before BatchNorm's conversion and the engine), then
    ``build``."""

    def __init__(self, request: TeacherRequest, config, dims) -> None:
        self.request, self.config, self.dims = request, config, dims
        self.network: nn.Module | None = None

    @classmethod
    def of_job(cls, objective, config, dims) -> TeacherSetup | None:
        """None when ``objective`` asks for no teacher; refuses a setup that cannot give one."""
        request = objective.teacher_request()
        if request is None:
            return None
        loader = config.data.loader
        ds_config = load_deepspeed_config(config.deepspeed_config, loader.batch_size, config.optim.clip_grad_norm)
        refuse_teacher_setup(request, config.objective.name, ds_config, config.deepspeed_config,
                             loader.view_layout.num_views)
        return cls(request, config, dims)

    def copy_network(self, model: nn.Module) -> None:
        """The teacher starts as ``model`` (a plain network, before any process group is attached)."""
        self.network = copy.deepcopy(model)

    def batch_norm(self, student_group) -> tuple[str, object]:
        """(mode, group) of the teacher's BatchNorm layers: the student's, or SyncBatchNorm over every
        data-parallel rank where the request asks for it."""
        if self.request.sync_batch_norm:
            return "sync", self.dims.data_parallel_group
        return self.config.model.batch_norm, student_group

    def statistics_differ(self, student_group) -> bool:
        """Whether the ranks' teachers hold different running statistics (averaged when saved)."""
        mode, group = self.batch_norm(student_group)
        return statistics_differ_by_rank(mode, group, self.dims)

    def build(self, engine, total_steps: int, student_group, synchronize_alone: bool = False) -> MomentumTeacher:
        """The teacher on the device in fp32, as the student's masters are now (collective under ZeRO-1/2)."""
        mode, group = self.batch_norm(student_group)
        network = apply_batch_norm_mode(self.network, mode, group, synchronize_alone)
        network = network.to(self.dims.device, torch.float32).train()
        self.network = None
        return MomentumTeacher(self.request, network, engine, total_steps)
