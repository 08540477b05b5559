"""The plain baseline of `instcls bench step --baseline`: the registry's optimizer on torch's foreach
(CPU) or fused (CUDA) kernels, stepping as the registry's own does; the precision DeepSpeed's
engine computes in, read from its config; and its bf16 gradients averaged in fp32, as the
config's communication_data_type asks."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainer.bench import step_baseline
from trainer.bench.op_counting import OpCounter
from trainer.bench.step_baseline import engine_precision, with_fastest_kernels
from trainer.optim import OptimizerSettings, build_optimizer

CPU = torch.device("cpu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _sgd_reference(weights: list[torch.Tensor], grads: list[list[torch.Tensor]], lr: float, momentum: float,
                   weight_decay: float) -> list[torch.Tensor]:
    """Momentum SGD in float64 by its formula: b <- m b + g + wd w (b = g + wd w first); w <- w - lr b."""
    weights = [w.double() for w in weights]
    buffers = [None] * len(weights)
    for step_grads in grads:
        for i, (w, g) in enumerate(zip(weights, step_grads)):
            d = g.double() + weight_decay * w
            buffers[i] = d if buffers[i] is None else momentum * buffers[i] + d
            weights[i] = w - lr * buffers[i]
    return weights


def test_the_registrys_sgd_steps_on_foreach_kernels_on_cpu_and_still_steps_sgd():
    model = _model()
    settings = OptimizerSettings(name="sgd", momentum=0.9, weight_decay=1e-2, exclude_from_decay=False)
    built = build_optimizer(settings, model, lr=0.1)
    optimizer = with_fastest_kernels(built, CPU)
    assert type(optimizer) is type(built)  # the registry's class: its conditional step and state
    assert all(group["foreach"] and not group["fused"] for group in optimizer.param_groups)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        with OpCounter() as ops:
            optimizer.step()
    assert ops.total < len(params)  # foreach: a few ops over all tensors, not a few per tensor
    expected = _sgd_reference(start, grads, lr=0.1, momentum=0.9, weight_decay=1e-2)
    for param, reference in zip(params, expected):
        torch.testing.assert_close(param.double(), reference, rtol=1e-5, atol=1e-6)


def test_on_cuda_torchs_optimizers_take_the_fused_kernel_and_the_groups_keep_their_settings():
    model = _model()
    settings = OptimizerSettings(name="sgd", momentum=0.9, weight_decay=1e-4)  # sgd: every tensor decayed
    built = build_optimizer(settings, model, lr=0.2)
    optimizer = with_fastest_kernels(built, torch.device("cuda"))  # the switch only; the tensors stay here
    assert all(group["fused"] and not group["foreach"] for group in optimizer.param_groups)
    keys = ("lr", "momentum", "weight_decay", "dampening", "nesterov")
    assert [{k: g[k] for k in keys} for g in optimizer.param_groups] == \
        [{k: g[k] for k in keys} for g in built.param_groups]
    assert [g["params"] for g in optimizer.param_groups] == [g["params"] for g in built.param_groups]


@pytest.mark.parametrize("name", ["lars", "adamw"])
def test_lars_and_an_already_fused_adamw_stay_as_the_registry_built_them(name):
    built = build_optimizer(OptimizerSettings(name=name), _model(), lr=0.1)
    assert with_fastest_kernels(built, CPU) is built


@pytest.mark.parametrize(("ds_config", "precision"), [
    ({"bf16": {"enabled": False}}, "fp32"),
    ({"bf16": {"enabled": True}}, "bf16"),
    ({"bf16": {"enabled": False}, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "autocast"),
    ({}, "fp32"),
])
def test_the_baseline_computes_in_the_precision_the_deepspeed_config_gives_the_engine(ds_config, precision):
    assert engine_precision(ds_config) == precision


def _rank_values(rank: int) -> torch.Tensor:
    """bf16 gradients whose average over 3 ranks a bf16 reduction gets wrong: 1 on rank 0, 2^-8
    elsewhere (a bf16 sum rounds 1 + 2^-8 back to 1)."""
    return torch.full((4,), 1.0 if rank == 0 else 2.0 ** -8, dtype=torch.bfloat16)


def test_the_gradient_hook_averages_bf16_gradients_in_fp32_and_writes_the_average_back(monkeypatch):
    ranks = 3

    def all_reduce(tensor, group=None, async_op=False):
        """Rank 0's view of a sum over 3 ranks, computed in the dtype it is handed, as gloo and NCCL do."""
        tensor.copy_(sum(_rank_values(r).to(tensor.dtype) / ranks for r in range(ranks)))
        future = torch.futures.Future()
        future.set_result([tensor])
        return SimpleNamespace(get_future=lambda: future)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: ranks)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    buffer = _rank_values(0)
    averaged = step_baseline._reduce_in_fp32(None, SimpleNamespace(buffer=lambda: buffer)).wait()
    assert averaged.dtype == torch.bfloat16 and averaged.data_ptr() == buffer.data_ptr()  # DDP's bucket, in place
    exact = sum(_rank_values(r).double() for r in range(ranks)) / ranks
    in_bf16 = sum(_rank_values(r) / ranks for r in range(ranks))
    assert not torch.equal(in_bf16, exact.bfloat16())  # the values tell the two reductions apart
    assert torch.equal(averaged, exact.bfloat16())  # one rounding, of the fp32 average
