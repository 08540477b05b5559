"""The momentum teacher as a checkpoint entry: ``teacher/model.pt`` and each rank's own statistics.

The teacher is whole and alike on every rank (``trainer.engine.momentum_teacher``), so rank 0 writes
it once, fp32, under the student network's state-dict names: ``teacher/model.pt``, what
``instcls export --teacher`` reads.  Its BatchNorm running statistics are the teacher's own; where
they differ by rank (``model.batch_norm: local``) ``model.pt`` holds their average over the ranks,
and every rank also writes its own (``teacher/batch_norm/rank-XXXXX.pt``), so a resume on the same
ranks continues bit for bit, as ``trainer.checkpoint.batch_norm_state`` does for the student.  On
another number of ranks every rank loads ``model.pt``: the weights, whole, need no re-splitting, and
the statistics start from the average.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.checkpoint.checkpoint_files import rank_file, read_trainer_meta
from trainer.checkpoint.safe_load import load_data
from trainer.checkpoint.save_plan import FileWrite, HostBuffers, SavePlan
from trainer.parallel import ParallelDims
from trainer.parallel.batch_norm import averaged_running_statistics, running_statistics

TEACHER_FOLDER = "teacher"
TEACHER_FILE = f"{TEACHER_FOLDER}/model.pt"


def load_teacher_weights(checkpoint_dir: Path) -> dict:
    """The teacher's fp32 network (backbone + head) of a checkpoint, as a state dict on the CPU."""
    file = Path(checkpoint_dir) / TEACHER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: {checkpoint_dir} holds no momentum teacher (its objective did "
                                "not ask for one, or it is not a complete checkpoint); export the student instead "
                                "(leave out --teacher)")
    return load_data(file, map_location="cpu")


class TeacherState:
    """A ``DirectoryState`` of ``teacher`` (a ``MomentumTeacher``); ``statistics_differ``: the ranks'
    BatchNorm statistics differ (``TeacherSetup.statistics_differ``)."""

    def __init__(self, teacher, statistics_differ: bool) -> None:
        self.teacher, self.statistics_differ = teacher, statistics_differ
        self.buffers = HostBuffers()  # rank 0's fp32 copies, reused save after save

    def _host_copy(self, name: str, value: torch.Tensor) -> torch.Tensor:
        if value.is_floating_point():
            return self.buffers.copy(name, value)
        return value.detach().to("cpu", copy=True)  # BatchNorm's num_batches_tracked keeps its integers

    def snapshot(self, path: Path, dims: ParallelDims, step: int) -> SavePlan:
        """Collective where the statistics differ by rank (their average)."""
        network = self.teacher.network
        averaged: dict[str, torch.Tensor] = {}
        if self.statistics_differ:
            averaged, _ = averaged_running_statistics(network, dims.data_parallel_group)
        plan: SavePlan = []
        if dims.rank == 0:
            weights = {name: self._host_copy(name, averaged.get(name, value))
                       for name, value in network.state_dict().items()}
            plan.append(FileWrite(TEACHER_FILE, weights, owned=True))
        if self.statistics_differ:  # live buffers: the save stages host copies
            plan.append(FileWrite(f"{TEACHER_FOLDER}/batch_norm/{rank_file(dims.rank)}", running_statistics(network)))
        return plan

    def load_from(self, path: Path, dims: ParallelDims) -> None:
        network = self.teacher.network
        with torch.no_grad():  # in place: the teacher's parameters are views into its flat buffers
            network.load_state_dict(load_teacher_weights(path))
        own = Path(path) / TEACHER_FOLDER / "batch_norm" / rank_file(dims.rank)
        if not own.is_file() or read_trainer_meta(path)["world_size"] != dims.world_size:
            return
        saved = load_data(own, map_location="cpu")
        with torch.no_grad():
            for name, buffer in running_statistics(network).items():
                buffer.copy_(saved[name])
