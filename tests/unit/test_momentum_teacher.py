"""The momentum teacher at ZeRO-0 with the job's own optimizer (``zero0``, ``zero0_autocast_bf16``: the
module's fp32 parameters are the masters): its update is the hand-written fp32 EMA of those tensors,
a step dropped on the device moves nothing (weights or BatchNorm statistics) and reads nothing on the
host, its forward is the teacher network's own without gradient, and a request the job cannot serve
is refused naming the field."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from data_pipeline.contract import ViewLayout
from tests.helpers.data_dependent_ops import DataDependentOps
from trainer.config_building import ConfigError
from trainer.engine.momentum_teacher import MomentumTeacher
from trainer.engine.teacher_setup import refuse_teacher_setup
from trainer.objectives import TeacherRequest


class _TwoBatches(nn.Module):
    """A network that, like ``InstanceModel``, takes a list of batches and returns one output each."""

    def __init__(self) -> None:
        super().__init__()
        # No bias before the BatchNorm: its gradient is zero in exact arithmetic, so whether a step moves
        # it would depend on rounding (on the machine's thread count).
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(12, 6, bias=False), nn.BatchNorm1d(6), nn.ReLU(),
                                  nn.Linear(6, 4))

    def forward(self, batches):
        return [self.body(batch) for batch in batches]


def _student(momentum: float = 0.9, schedule: str = "constant", views=(1,)):
    torch.manual_seed(0)
    network = _TwoBatches()
    optimizer = torch.optim.SGD(network.parameters(), lr=0.5, momentum=0.9)
    engine = SimpleNamespace(module=network, optimizer=optimizer, zero_optimization_stage=lambda: 0)
    teacher = MomentumTeacher(TeacherRequest(views=views, momentum=momentum, schedule=schedule),
                              copy.deepcopy(network), engine, total_steps=10)
    return network, optimizer, teacher


def _train_step(network, optimizer) -> None:
    network(list(torch.randn(2, 5, 3, 2, 2)))[0].pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _teacher_state(teacher) -> list[torch.Tensor]:
    return [t.detach().clone() for t in teacher.network.state_dict().values()]


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_the_update_is_the_fp32_ema_of_the_parameters_the_optimizer_steps(schedule):
    network, optimizer, teacher = _student(momentum=0.9, schedule=schedule)
    for name, parameter in teacher.network.named_parameters():  # starts as the student, fp32, frozen
        assert torch.equal(parameter, dict(network.named_parameters())[name]) and not parameter.requires_grad
    for step in range(3):
        before = {name: p.detach().clone() for name, p in teacher.network.named_parameters()}
        _train_step(network, optimizer)
        teacher.update(step, True)
        m = 0.9 if schedule == "constant" else 1 - 0.1 * (math.cos(math.pi * step / 10) + 1) / 2
        for name, student in network.named_parameters():
            moved = dict(teacher.network.named_parameters())[name]
            assert moved.dtype == torch.float32
            assert torch.equal(moved, before[name] * m + student.detach() * (1 - m)), name
            exact = before[name].double() * m + student.detach().double() * (1 - m)
            torch.testing.assert_close(moved.double(), exact, rtol=0, atol=1e-6)
            assert not torch.equal(moved, student) and not torch.equal(moved, before[name])


def test_the_cosine_schedule_rises_from_the_base_momentum_to_one():
    request = TeacherRequest(views=(0,), momentum=0.996, schedule="cosine")
    values = [request.momentum_at(k, 100) for k in range(101)]
    assert values[0] == pytest.approx(0.996) and values[100] == pytest.approx(1.0)
    assert values[50] == pytest.approx((0.996 + 1) / 2)
    assert all(a < b for a, b in zip(values, values[1:]))
    assert TeacherRequest(views=(0,), momentum=0.99).momentum_at(57, 100) == 0.99


def test_a_step_dropped_on_the_device_moves_nothing_and_reads_nothing_on_the_host():
    """What the trainer does at ZeRO-0 under skip_step: statistics remembered before the teacher's
    forward, the update and the put-back given the device's flag."""
    network, optimizer, teacher = _student()
    teacher.remember_buffers()
    teacher.encode(list(torch.randn(2, 5, 3, 2, 2)), ViewLayout(("global",) * 2, (2, 2)), torch.float32,
                   SimpleNamespace(channels_last=False))
    before = _teacher_state(teacher)  # the forward moved the statistics; the put-back must undo it
    teacher.remember_buffers()
    teacher.encode(list(torch.randn(2, 5, 3, 2, 2)), ViewLayout(("global",) * 2, (2, 2)), torch.float32,
                   SimpleNamespace(channels_last=False))
    _train_step(network, optimizer)  # the student moved (a dropped step would not have, but the flag rules)
    with DataDependentOps() as reads:
        teacher.after_step(0, torch.tensor(False))
    assert reads.ops == []
    assert all(torch.equal(a, b) for a, b in zip(before, _teacher_state(teacher)))
    teacher.after_step(0, False)  # DeepSpeed's own drop, known on the host
    assert all(torch.equal(a, b) for a, b in zip(before, _teacher_state(teacher)))
    teacher.after_step(0, torch.tensor(True))
    assert not all(torch.equal(a, b) for a, b in zip(before, _teacher_state(teacher)))


def test_a_kept_step_on_the_device_path_is_the_plain_update():
    network, optimizer, teacher = _student()
    plain = copy.deepcopy(teacher.network)
    _train_step(network, optimizer)
    teacher.update(4, torch.tensor(True))
    for name, parameter in plain.named_parameters():
        student = dict(network.named_parameters())[name].detach()
        assert torch.equal(dict(teacher.network.named_parameters())[name], parameter * 0.9 + student * (1 - 0.9))


def test_the_teacher_encodes_only_the_requested_views_without_gradient_with_its_own_statistics():
    network, _, teacher = _student(views=(2, 0))
    images = list(torch.randn(3, 5, 3, 2, 2))
    layout = ViewLayout(("global", "global", "small"), (4, 4, 2))  # views 0 and 2 are forwarded apart
    expected = copy.deepcopy(teacher.network)
    student_statistics = network.body[2].running_mean.clone()
    features = teacher.encode(images, layout, torch.float32, SimpleNamespace(channels_last=False))
    assert [(view.index, view.kind) for view in features] == [(2, "small"), (0, "global")]
    assert all(not view.features.requires_grad for view in features)
    first, second = expected([images[0]])[0], expected([images[2]])[0]  # in the order the forwards run
    assert torch.equal(features[0].features, second) and torch.equal(features[1].features, first)
    assert torch.equal(teacher.network.body[2].running_mean, expected.body[2].running_mean)
    assert not torch.equal(teacher.network.body[2].running_mean, student_statistics)
    assert torch.equal(network.body[2].running_mean, student_statistics)  # the student's are left alone


@pytest.mark.parametrize("momentum", [-0.01, 1.5, float("nan"), "0.99", True])
def test_a_momentum_outside_zero_to_one_is_refused_naming_the_field(momentum):
    with pytest.raises(ValueError, match=r"objective\.momentum=.* is invalid: the teacher's momentum must be a number "
                                         r"in \[0, 1\]"):
        TeacherRequest(views=(1,), momentum=momentum, field="objective.momentum")


def test_other_bad_requests_are_refused_naming_what_to_change():
    with pytest.raises(ValueError, match="schedule 'linear'.*use one of constant, cosine"):
        TeacherRequest(views=(1,), momentum=0.99, schedule="linear")
    with pytest.raises(ValueError, match="distinct view positions"):
        TeacherRequest(views=(1, 1), momentum=0.99)
    with pytest.raises(ConfigError, match=r"encodes views \[0, 2\].*makes 2 views a sample.*num_views"):
        refuse_teacher_setup(TeacherRequest(views=(0, 2), momentum=0.99), "toy", {}, "ds_configs/zero0.json", 2)


def test_setups_that_cannot_keep_a_teacher_are_refused_naming_the_field():
    request = TeacherRequest(views=(1,), momentum=0.999)
    with pytest.raises(ConfigError, match=r"objective.name='moco' needs a momentum teacher.*"
                                          r"deepspeed_config=zero3\.json sets zero_optimization.stage=3: use a stage "
                                          r"0-2 config"):
        refuse_teacher_setup(request, "moco", {"zero_optimization": {"stage": 3}}, "zero3.json", 2)
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match="zero_optimization.offload_optimizer.device='cpu'"):
        refuse_teacher_setup(request, "moco", offload, "mine.json", 2)
    for stage in (0, 1, 2):
        refuse_teacher_setup(request, "moco", {"zero_optimization": {"stage": stage}}, "ok.json", 2)


def test_the_trainer_refuses_at_start_a_job_that_cannot_keep_the_requested_teacher():
    """What ``Trainer`` calls before DeepSpeed starts, with the job's own DeepSpeed file."""
    from trainer.config import load_job_config
    from trainer.engine.teacher_setup import TeacherSetup
    from trainer.parallel import single_process_dims

    def asking(momentum):
        return SimpleNamespace(teacher_request=lambda: TeacherRequest(views=(1,), momentum=momentum))

    dims = single_process_dims(torch.device("cpu"))
    config = load_job_config("configs/digits_cpu.yaml", ["deepspeed_config=zero3_bf16"])
    with pytest.raises(ConfigError, match=r"deepspeed_config=.*zero3_bf16\.json sets zero_optimization.stage=3"):
        TeacherSetup.of_job(asking(0.999), config, dims)
    config = load_job_config("configs/digits_cpu.yaml", ["deepspeed_config=zero2_bf16"])
    assert TeacherSetup.of_job(asking(0.999), config, dims) is not None
    assert TeacherSetup.of_job(SimpleNamespace(teacher_request=lambda: None), config, dims) is None
    with pytest.raises(ValueError, match=r"objective\.momentum=1\.001 is invalid"):
        TeacherSetup.of_job(asking(1.001), config, dims)


def test_the_teacher_step_on_the_device_path_makes_no_host_sync_on_a_cuda_device():
    """On fake CUDA tensors (no GPU needed): the statistics' copy, the masked update and the put-back of
    a step whose flag lives on the device neither read the device nor copy host data to it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.dry_run.host_syncs import HostSyncRecorder

    with FakeTensorMode(), torch.device("cuda"):
        network = _TwoBatches()
        optimizer = torch.optim.SGD(network.parameters(), lr=0.5)
        engine = SimpleNamespace(module=network, optimizer=optimizer, zero_optimization_stage=lambda: 0)
        teacher = MomentumTeacher(TeacherRequest(views=(0,), momentum=0.99, schedule="cosine"), _TwoBatches(),
                                  engine, total_steps=10)  # a copy of the same layers (synced from the student)
        taken = torch.randn((), device="cuda") > 0
        with HostSyncRecorder() as recorder:
            teacher.remember_buffers()
            teacher.after_step(3, taken)
    assert recorder.syncs == []


@pytest.mark.parametrize("sync", [False, True])
def test_the_teacher_keeps_the_students_batch_norm_or_synchronises_it_as_the_request_says(sync):
    from trainer.config import load_job_config
    from trainer.engine.teacher_setup import TeacherSetup
    from trainer.parallel import single_process_dims
    from trainer.parallel.sync_batch_norm import SyncBatchNorm

    config = load_job_config("configs/digits_cpu.yaml", [])  # model.batch_norm: local
    request = TeacherRequest(views=(1,), momentum=0.99, sync_batch_norm=sync)
    setup = TeacherSetup.of_job(SimpleNamespace(teacher_request=lambda: request), config,
                                single_process_dims(torch.device("cpu")))
    network, optimizer, _ = _student()
    setup.copy_network(network)
    engine = SimpleNamespace(module=network, optimizer=optimizer, zero_optimization_stage=lambda: 0)
    teacher = setup.build(engine, 10, None, synchronize_alone=True)  # one process runs the synchronised path
    assert isinstance(teacher.network.body[2], SyncBatchNorm) == sync
    assert not isinstance(network.body[2], SyncBatchNorm)
    assert setup.statistics_differ(None) == (not sync)  # local statistics differ by rank; synchronised ones agree


def test_under_a_bf16_engine_the_fp32_teacher_encodes_in_bf16_through_its_batch_norm():
    """The engine's dtype is bf16 (a ``*_bf16`` config or autocast): the teacher keeps fp32 weights and
    statistics and runs under autocast, close to its own fp32 forward."""
    from trainer.models import ModelConfig, build_model

    model_config = ModelConfig(arch="resnet10", small_input_stem=True, head_hidden_dim=16, feature_dim=8)
    torch.manual_seed(0)
    network = build_model(model_config)
    engine = SimpleNamespace(module=network, optimizer=torch.optim.SGD(network.parameters(), lr=0.1),
                             zero_optimization_stage=lambda: 0)
    teacher = MomentumTeacher(TeacherRequest(views=(0, 1), momentum=0.9), copy.deepcopy(network).train(), engine, 10)
    in_fp32 = copy.deepcopy(teacher.network)
    images = list(torch.randn(2, 4, 3, 16, 16))
    layout = ViewLayout(("global", "global"), (16, 16))
    features = teacher.encode(images, layout, torch.bfloat16, model_config)
    (expected,) = in_fp32([torch.cat(images)])
    assert all(view.features.dtype == torch.bfloat16 for view in features)
    assert all(t.dtype == torch.float32 for t in teacher.network.state_dict().values() if t.is_floating_point())
    got = torch.cat([view.features.float() for view in features])
    assert torch.nn.functional.cosine_similarity(got, expected, dim=1).min() > 0.99
