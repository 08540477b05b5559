"""The optimizer registry on one process: which tensors decay and which adapt, LARS against a
float64 LARC reference, the conditional step (a False flag changes nothing, and no step reads a
flag or a norm on the host), and the registry's own contract."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.helpers.lars_reference import larc_sgd_step
from trainer.dry_run.host_syncs import HostSyncRecorder
from trainer.optim import (
    OptimizerSettings,
    build_optimizer,
    excluded_from_decay,
    optimizer_names,
    optimizer_spec,
    parameter_groups,
)
from trainer.optim.param_groups import group_of


class TokenModel(nn.Module):
    """A toy with every kind of parameter: conv + BatchNorm, a linear with bias, a LayerNorm, a
    position embedding and class token (as timm names them), and a block declaring its own."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.pos_embed = nn.Parameter(torch.randn(1, 5, 4) * 0.02)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 4) * 0.02)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)
        self.block = Declaring()


class Declaring(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.relative_bias_table = nn.Parameter(torch.randn(3, 4))  # 2-D, kept out by its module's word

    def no_weight_decay(self) -> set[str]:
        return {"relative_bias_table"}


def test_norms_biases_position_embeddings_and_class_tokens_are_excluded_from_decay_and_adaptation():
    model = TokenModel()
    assert excluded_from_decay(model) == {"bn.weight", "bn.bias", "pos_embed", "cls_token", "norm.weight",
                                          "norm.bias", "head.bias", "block.relative_bias_table"}
    groups = parameter_groups(model, weight_decay=1e-4, exclude_from_decay=True)
    named = dict(model.named_parameters())
    decayed = {name for name, p in named.items() if group_of(groups, p)["decay"]}
    adapted = {name for name, p in named.items() if group_of(groups, p)["adapt"]}
    assert decayed == adapted == {"conv.weight", "head.weight", "block.weight"}
    assert [g["weight_decay"] for g in groups] == [1e-4, 0.0]


def test_without_exclusion_every_parameter_decays_and_adapts_in_one_group():
    model = TokenModel()
    model.conv.weight.requires_grad_(False)  # frozen parameters are in no group
    groups = parameter_groups(model, weight_decay=1e-6, exclude_from_decay=False)
    assert len(groups) == 1 and groups[0]["decay"] and groups[0]["adapt"] and groups[0]["weight_decay"] == 1e-6
    assert len(groups[0]["params"]) == len(list(model.parameters())) - 1


@pytest.mark.parametrize("name, excludes", [("sgd", False), ("lars", True), ("adamw", True)])
def test_each_optimizer_builds_its_groups_with_its_own_default_exclusion(name, excludes):
    optimizer = build_optimizer(OptimizerSettings(name=name, weight_decay=0.05), TokenModel(), lr=0.1)
    assert len(optimizer.param_groups) == (2 if excludes else 1)
    assert optimizer.param_groups[0]["weight_decay"] == 0.05
    forced = build_optimizer(OptimizerSettings(name=name, exclude_from_decay=not excludes), TokenModel(), lr=0.1)
    assert len(forced.param_groups) == (1 if excludes else 2)


def test_the_registry_names_its_optimizers_their_state_bytes_and_refuses_an_unknown_name():
    assert optimizer_names() == ["adamw", "lars", "sgd"]
    assert [optimizer_spec(n).state_bytes_per_parameter for n in ("sgd", "lars", "adamw")] == [4, 4, 8]
    with pytest.raises(ValueError, match="optim.name='lamb' is not a registered optimizer: choose one of adamw, "
                                         "lars, sgd"):
        optimizer_spec("lamb")


def _gradients(model: nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for parameter in model.parameters():
        parameter.grad = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)


def test_lars_matches_a_float64_larc_reference_over_5_steps_in_both_groups():
    """Adapted tensors (decayed), the excluded group (neither), and a tensor with zero norm, which
    LARC steps without decay or scaling."""
    torch.manual_seed(0)
    model = TokenModel()
    with torch.no_grad():
        model.head.weight.zero_()
    settings = OptimizerSettings(name="lars", momentum=0.9, weight_decay=0.01, trust_coefficient=0.02)
    optimizer = build_optimizer(settings, model, lr=1.5)
    reference = [p.detach().double().clone() for p in model.parameters()]
    initial = [p.detach().clone() for p in model.parameters()]
    groups = [group_of(optimizer.param_groups, p) for p in model.parameters()]
    buffers = [None] * len(reference)
    for step in range(5):
        _gradients(model, step)
        grads = [p.grad.double() for p in model.parameters()]
        optimizer.step()
        buffers = larc_sgd_step(reference, grads, buffers, lr=1.5, momentum=0.9,
                                weight_decays=[g["weight_decay"] for g in groups],
                                adapted=[g["adapt"] for g in groups], trust_coefficient=0.02)
    for parameter, expected, start in zip(model.parameters(), reference, initial):
        assert (parameter.detach() - start).abs().max() > 1e-3  # every tensor moved: the check has teeth
        torch.testing.assert_close(parameter.detach().double(), expected, rtol=1e-5, atol=1e-7)


def _state(optimizer) -> list[torch.Tensor]:
    return [v.clone() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


@pytest.mark.parametrize("name", ["sgd", "lars", "adamw"])
def test_a_false_flag_leaves_weights_and_state_untouched_even_with_nonfinite_gradients(name):
    torch.manual_seed(0)
    model = TokenModel()
    optimizer = build_optimizer(OptimizerSettings(name=name, weight_decay=0.01), model, lr=0.1)
    _gradients(model, 0)
    optimizer.step()  # there is state to keep
    weights, state = [p.detach().clone() for p in model.parameters()], _state(optimizer)
    _gradients(model, 1)
    model.head.weight.grad[0, 0] = float("nan")
    model.conv.weight.grad[0, 0, 0, 0] = float("inf")
    optimizer.step(apply=torch.tensor(False))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(a, b) for a, b in zip(_state(optimizer), state))

    optimizer.set_step_condition(torch.tensor(False))  # the form DeepSpeed's argument-less step() sees
    optimizer.step()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    optimizer.set_step_condition(None)


@pytest.mark.parametrize("name", ["sgd", "lars", "adamw"])
def test_a_true_flag_steps_as_the_plain_step_does(name):
    results = []
    for apply in (None, torch.tensor(True)):
        torch.manual_seed(0)
        model = TokenModel()
        optimizer = build_optimizer(OptimizerSettings(name=name, weight_decay=0.01), model, lr=0.1)
        for step in range(3):
            _gradients(model, step)
            optimizer.step(apply=apply)
        results.append([p.detach().clone() for p in model.parameters()] + _state(optimizer))
        if name == "adamw":
            assert [float(s["step"]) for s in optimizer.state.values()] == [3.0] * len(optimizer.state)
    for plain, flagged in zip(*results):
        torch.testing.assert_close(flagged, plain, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["sgd", "lars", "adamw"])
def test_the_conditional_step_reads_nothing_on_the_host_on_a_gpu(name):
    """On fake CUDA tensors (no GPU needed) the recorder sees every host sync a real GPU would."""
    with FakeTensorMode():
        with torch.device("cuda"):
            model = TokenModel()
        optimizer = build_optimizer(OptimizerSettings(name=name, weight_decay=0.01), model, lr=0.1)
        flag = torch.ones((), dtype=torch.bool, device="cuda")
        for parameter in model.parameters():
            parameter.grad = torch.ones_like(parameter)
        with HostSyncRecorder() as recorder:
            for _ in range(2):
                optimizer.step(apply=flag)
    assert recorder.syncs == []


def test_sgd_steps_a_param_group_with_foreach_kernels_and_the_per_tensor_loops_numbers():
    """One op per update for the whole group (what a GPU launches: torch's CUDA default), on every
    device, with the numbers of torch's per-tensor loop bit for bit."""
    from torch import nn

    from trainer.bench.op_counting import OpCounter
    from trainer.optim import OptimizerSettings, build_optimizer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])  # 10 tensors
    reference = copy.deepcopy(model)
    optimizer = build_optimizer(OptimizerSettings(name="sgd", momentum=0.9, weight_decay=1e-4), model, 0.1)
    looped = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=False)
    for step in range(3):
        for network in (model, reference):
            network(torch.randn(2, 4, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        with OpCounter() as ops:
            optimizer.step()
        looped.step()
        optimizer.zero_grad()
        looped.zero_grad()
    assert all(name.startswith("aten._foreach") for name in ops.by_op), ops.by_op
    assert ops.total <= 4  # decay, momentum (mul, add), update: not 10 tensors x 3 ops
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
