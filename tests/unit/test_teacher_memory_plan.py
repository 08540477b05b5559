"""`instcls plan` and the dry run see an objective's momentum teacher from its config alone: the plan
adds an fp32 copy of the network per rank (and rank 0's host copy of it at a CPU save) and recommends
only the ZeRO stages that keep a teacher; the dry run hands the objective stand-in teacher features."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainer.config import load_job_config
from trainer.dry_run.rank_step import _StepInputs
from trainer.models import build_model
from trainer.objectives import InstanceConfig, TeacherRequest
from trainer.parallel import single_process_dims
from trainer.planning import GIB, predict, recommend_stage
from trainer.planning.plan_from_config import plan_input_from_config


@dataclass(frozen=True)
class _InstanceWithTeacher(InstanceConfig):
    """The instance objective's settings and memory, asking for a teacher of its second view."""

    def teacher_request(self, views):
        return TeacherRequest(views=(1,), momentum=0.99)


def _configs():
    config = load_job_config("configs/digits_cpu.yaml", ["model.arch=resnet10", "model.head_hidden_dim=32",
                                                         "parallel.device=cpu", "checkpoint.every_steps=10"])
    return config, replace(config, objective=_InstanceWithTeacher())


def test_the_plan_counts_the_teacher_as_an_fp32_copy_of_the_network_and_recommends_no_zero3():
    plain, with_teacher = (plan_input_from_config(c, ranks=2, num_classes=1000) for c in _configs())
    assert (plain.teacher, with_teacher.teacher) == (False, True)
    parameters = sum(p.numel() for p in build_model(_configs()[0].model).parameters())  # counted apart
    without, added = predict(plain), predict(with_teacher)
    assert set(added) - set(without) == {"momentum teacher (fp32 copy)", "checkpoint copies: teacher/model.pt"}
    assert added["momentum teacher (fp32 copy)"] == added["checkpoint copies: teacher/model.pt"] == 4 * parameters
    assert all(added[key] == value for key, value in without.items())
    assert set(recommend_stage(with_teacher, 1024 * GIB).stages.totals) == {0, 1, 2}
    assert set(recommend_stage(plain, 1024 * GIB).stages.totals) == {0, 1, 2, 3}


def test_the_dry_run_hands_the_objective_teacher_features_of_the_requested_views():
    config = _configs()[1]
    inputs = _StepInputs(config, single_process_dims(torch.device("cpu")), 256, torch.float32)
    step = inputs.step(0, 0)
    assert [(view.index, view.kind) for view in step.teacher] == [(1, "global")]
    (teacher,) = step.teacher
    assert teacher.features.shape == step.views[1].features.shape and not teacher.features.requires_grad
    assert _StepInputs(_configs()[0], single_process_dims(torch.device("cpu")), 256, torch.float32).step(0, 0).teacher \
        == []
