"""The momentum teacher an objective asks for (``TeacherRequest``): an fp32 copy of the backbone and
head, run without gradient on the views the objective names and moved towards the student after every
optimizer step that was taken.

Update.  After optimizer step ``k``: ``teacher = m_k * teacher + (1 - m_k) * master`` in fp32, where
``master`` is the student's fp32 weight the optimizer steps (``trainer.engine.teacher_masters`` names
the tensor for each DeepSpeed setup: never the bf16 module copy) and ``m_k`` the request's schedule.
Below ZeRO the teacher is whole on every rank and each rank moves it alike; under ZeRO-1/2 each rank
moves the part of the teacher that lines up with its fp32 master partition and the parts are
all-gathered (fp32), as DeepSpeed all-gathers the student after its step.  ZeRO-3 is refused
(``trainer.engine.teacher_setup``).

Skipped steps.  A step that changed nothing does not move the teacher: the trainer does not call
``update`` for a step dropped before its backward (``optim.on_nonfinite: skip_step`` agreed on the
host) or dropped by DeepSpeed itself (its overflow check); where the drop is decided on the device
(``trainer.engine.device_skip``, ZeRO-0) ``update`` takes the flag as a 0-dim bool tensor and keeps
the old values where it is False (``torch.where``), with no host read.  The teacher's BatchNorm
statistics, which its forward moved, are put back the same ways (``remember_buffers``).

BatchNorm.  The teacher's BatchNorm layers keep their own running statistics, from the teacher's own
training-mode forwards on the views it encodes, as MoCo's key encoder does; they are not an average
of the student's.  So an export of the teacher (``instcls export --teacher``) ships the statistics of
the teacher's own activations, the ones it normalises with.  Under ``model.batch_norm: local`` every
rank's differ, and what is saved (``teacher/model.pt``) is their average over the ranks, as for the
student; with ``TeacherRequest.sync_batch_norm`` (MoCo v2's keys) they are the global batch's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from trainer.engine.teacher_masters import MasterGroup, master_groups
from trainer.models.backbone import ModelConfig, model_input
from trainer.objectives import TeacherRequest, View


def _all_gather_single(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    # as trainer.parallel.collectives: torch 2.13 renamed the single-tensor all-gather
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, tensor, group=group)


class MomentumTeacher:
    """``network``: the teacher, an fp32 copy of the student network on the device (the same module
    names), in train mode; ``engine``: the student's DeepSpeed engine, whose fp32 masters it follows;
    ``total_steps``: the run's optimizer steps, for the schedule.  Built as the student's masters are
    now (``sync``); a resume then loads its own state (``trainer.checkpoint.teacher_state``)."""

    def __init__(self, request: TeacherRequest, network: nn.Module, engine, total_steps: int) -> None:
        self.request, self.network, self.engine, self.total_steps = request, network, engine, total_steps
        self.network.requires_grad_(False)
        by_name = dict(network.named_parameters())
        names = {id(p): name for name, p in engine.module.named_parameters()}
        self.flats: list[torch.Tensor] = []
        with torch.no_grad():
            for group in master_groups(engine):
                flat = torch.zeros(group.flat.numel(), dtype=torch.float32, device=group.master.device)
                for parameter in group.parameters:
                    offset = group.offset_of(parameter)
                    mine = by_name[names[id(parameter)]]
                    mine.data = flat[offset: offset + parameter.numel()].view(parameter.shape)
                self.flats.append(flat)
        self.sync()
        self._buffers_before: list[torch.Tensor] | None = None

    def _pieces(self) -> list[tuple[torch.Tensor, MasterGroup]]:
        """Each flat buffer's part this rank moves, with its master (read again each time: a resume may
        hand DeepSpeed new master tensors)."""
        groups = master_groups(self.engine)
        if len(groups) != len(self.flats):
            raise RuntimeError(f"the student's optimizer now has {len(groups)} parameter groups, the teacher was "
                               f"built for {len(self.flats)}")
        return [(flat.narrow(0, group.start, group.master.numel()), group) for flat, group in zip(self.flats, groups)]

    def _gather(self, flat: torch.Tensor, piece: torch.Tensor, group: MasterGroup) -> None:
        if group.group is None:
            return
        # NCCL gathers in place; gloo gets a separate input
        _all_gather_single(flat, piece if flat.is_cuda else piece.clone(), group.group)

    @torch.no_grad()
    def sync(self) -> None:
        """The teacher's weights become the student's fp32 masters (collective under ZeRO-1/2)."""
        for flat, (piece, group) in zip(self.flats, self._pieces()):
            piece.copy_(group.master)
            self._gather(flat, piece, group)

    @torch.no_grad()
    def update(self, step: int, taken: bool | torch.Tensor = True) -> None:
        """After optimizer step ``step`` (0-based): move towards the student's masters.  ``taken``: a
        0-dim bool tensor on the device (False: the step was dropped, nothing moves), never read on
        the host; a host ``False`` is not an update at all."""
        if taken is False:
            return
        momentum = self.request.momentum_at(step, self.total_steps)
        for flat, (piece, group) in zip(self.flats, self._pieces()):
            moved = piece * momentum + group.master * (1.0 - momentum)
            piece.copy_(moved if not torch.is_tensor(taken) else torch.where(taken, moved, piece))
            self._gather(flat, piece, group)

    def after_step(self, step: int, taken: bool | torch.Tensor) -> None:
        """After optimizer step ``step``: moved where it was ``taken``, its statistics put back where not."""
        self.update(step, taken)
        self.restore_buffers(taken)

    @torch.no_grad()
    def encode(self, images: list[torch.Tensor], layout, dtype: torch.dtype, model: ModelConfig) -> list[View]:
        """The teacher's head features (no gradient) of the requested views of ``images`` (the loader's
        views, in view order; ``layout`` its ``ViewLayout``), in the request's order.  Views of one side
        share a forward, as the student's do; the input takes the engine's ``dtype`` and, below fp32,
        runs under autocast in it (the teacher's weights stay fp32)."""
        wanted = set(self.request.views)
        groups = [[i for i in group if i in wanted] for group in layout.forward_groups()]
        groups = [group for group in groups if group]
        batches = [model_input(torch.cat([images[i] for i in group]), dtype, model) for group in groups]
        autocast = (torch.autocast(batches[0].device.type, dtype=dtype) if dtype != torch.float32
                    else contextlib.nullcontext())
        with autocast:
            outputs = self.network(batches)
        features: dict[int, torch.Tensor] = {}
        for group, output in zip(groups, outputs):
            for index, view_features in zip(group, output.chunk(len(group))):
                features[index] = view_features
        return [View(features=features[i], kind=layout.kinds[i], index=i) for i in self.request.views]

    def remember_buffers(self) -> None:
        """Before the teacher's forward of a step that may be dropped: a copy of its BatchNorm statistics."""
        self._buffers_before = [buffer.clone() for buffer in self.network.buffers()]

    @torch.no_grad()
    def restore_buffers(self, taken: bool | torch.Tensor = False) -> None:
        """The statistics as ``remember_buffers`` found them where the step was dropped (``taken``
        False, or a 0-dim device flag, used without a host read)."""
        remembered, self._buffers_before = self._buffers_before, None
        if remembered is None or taken is True:
            return
        for buffer, before in zip(self.network.buffers(), remembered):
            buffer.copy_(before if taken is False else torch.where(taken, buffer, before))
