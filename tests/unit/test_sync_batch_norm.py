"""``model.batch_norm: sync`` in one process and on fake ranks: a one-process run is plain BatchNorm
and trains with DeepSpeed's bf16 parameters next to fp32 statistics; on fake CUDA ranks the
forward and backward make no host sync (where torch's SyncBatchNorm's count filter makes one); the
conversion keeps every tensor and state-dict name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.helpers.data_dependent_ops import DataDependentOps
from trainer.bench.sync_batch_norm_check import pseudo_ranks
from trainer.dry_run.backward import backward
from trainer.dry_run.collectives import CollectiveRecorder
from trainer.dry_run.host_syncs import HostSyncRecorder
from trainer.models import ModelConfig, build_model
from trainer.parallel.batch_norm import apply_batch_norm_mode
from trainer.parallel.sync_batch_norm import SyncBatchNorm, convert_to_sync_batch_norm


def _as_deepspeed_casts_it(model: nn.Module) -> nn.Module:
    """DeepSpeed 0.19's bf16 cast: parameters only, buffers stay fp32."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    return model


def test_a_one_process_sync_model_trains_with_bf16_parameters_and_fp32_statistics():
    """The one-GPU SwAV run: every BatchNorm (the head's BatchNorm1d included) takes the mix."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="resnet10", small_input_stem=True, batch_norm="sync"))
    model = _as_deepspeed_casts_it(apply_batch_norm_mode(model, "sync", None))
    images = torch.randn(4, 3, 16, 16).to(torch.bfloat16)
    model(images).float().square().mean().backward()
    batch_norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert batch_norms and all(type(m) is SyncBatchNorm for m in batch_norms)
    assert all(m.running_mean.dtype == torch.float32 for m in batch_norms)
    assert all(m.weight.grad is not None and m.weight.grad.dtype == torch.bfloat16 for m in batch_norms)
    assert all(int(m.num_batches_tracked) == 1 for m in batch_norms)
    head_batch_norm = model.head[1]  # the layer a one-GPU run (NHWC backbone) failed in
    assert head_batch_norm(torch.randn(4, head_batch_norm.num_features).to(torch.bfloat16)).dtype == torch.bfloat16
    model.eval()
    assert torch.isfinite(model(images).float()).all()


@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_a_process_group_the_layer_is_plain_batch_norm(momentum):
    torch.manual_seed(1)
    plain = nn.BatchNorm2d(5, momentum=momentum)
    layer = convert_to_sync_batch_norm(copy.deepcopy(plain))
    for _ in range(2):
        x = torch.randn(6, 5, 3, 3) * 3 + 2
        assert torch.equal(layer(x), plain(x))
    assert torch.equal(layer.running_mean, plain.running_mean) and torch.equal(layer.running_var, plain.running_var)
    layer.eval(), plain.eval()
    assert torch.equal(layer(x), plain(x))


def test_the_forward_and_backward_make_no_host_sync_and_two_collectives_on_fake_cuda_ranks():
    """Rank 1 of 4 on fake CUDA tensors: one all-gather of [world, 2C + 1] forward, one all-reduce
    of 2C backward, and nothing the host waits for (value reads, data-sized outputs, host copies)."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        with FakeTensorMode():
            layer = SyncBatchNorm(8, device="cuda", dtype=torch.bfloat16)
            layer.running_mean = torch.zeros(8, device="cuda")  # fp32 statistics, as DeepSpeed leaves them
            layer.running_var = torch.ones(8, device="cuda")
            x = torch.empty(4, 8, 5, 5, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with HostSyncRecorder() as syncs, CollectiveRecorder() as collectives:
                out = layer(x)
                backward(out.float().sum())  # the autograd engine itself needs a driver
            assert out.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16
    finally:
        dist.destroy_process_group()
    assert [str(s) for s in syncs.syncs] == []
    assert [(c.op, c.tensors) for c in collectives.collectives] == [
        ("_allgather_base_", ("float32[4, 17]", "float32[1, 17]")), ("allreduce_", ("float32[16]",))]


def _torch_sync_batch_norm_count_filter(every_rank: torch.Tensor, channels: int):
    """torch.nn.SyncBatchNorm's forward (torch/nn/modules/_functions.py) after its all-gather: the
    ranks that held no samples dropped with a boolean mask."""
    mean_all, invstd_all, count_all = torch.split(every_rank, channels, dim=1)
    mask = count_all.squeeze(-1) >= 1
    return count_all[mask], mean_all[mask], invstd_all[mask]


def test_both_checks_catch_the_count_filter_of_torch_s_sync_batch_norm():
    """The checks above and in the multi-rank test would fail on torch's algorithm."""
    with FakeTensorMode(), HostSyncRecorder(assume_values=True) as syncs:
        _torch_sync_batch_norm_count_filter(torch.empty(4, 17, device="cuda"), 8)
    assert [s.kind for s in syncs.syncs] == ["data-dependent size"] * 3
    with DataDependentOps() as found:
        _torch_sync_batch_norm_count_filter(torch.rand(4, 17), 8)
        float(torch.ones(1))
    assert found.ops == ["aten.index.Tensor"] * 3 + ["aten._local_scalar_dense.default"]


class _BatchNormThenReLU(nn.BatchNorm2d):
    def forward(self, input):
        return super().forward(input).relu()


def test_conversion_keeps_tensors_and_names_and_refuses_a_forward_that_does_more():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(16, 5), nn.BatchNorm1d(5))
    keys, tensors = model.state_dict().keys(), [t.data_ptr() for t in model.state_dict().values()]
    converted = convert_to_sync_batch_norm(model)
    assert converted is model and type(model[1]) is SyncBatchNorm and type(model[4]) is SyncBatchNorm
    assert model.state_dict().keys() == keys and [t.data_ptr() for t in model.state_dict().values()] == tensors
    with pytest.raises(ValueError, match=r"cannot convert 1 \(_BatchNormThenReLU\).*model.batch_norm=local"):
        convert_to_sync_batch_norm(nn.Sequential(nn.Conv2d(3, 4, 3), _BatchNormThenReLU(4)))


def test_the_pseudo_rank_check_finds_the_pieces_exact_on_cpu():
    """The GPU check's first part (``trainer.bench.sync_batch_norm_check``), on the CPU's tensor path:
    k pseudo-ranks, one empty, against float64 BatchNorm over the whole batch."""
    errors = pseudo_ranks(torch.device("cpu"))
    assert set(errors) == {"output", "grad_input", "grad_weight", "grad_bias", "running_mean", "running_var"}
    assert max(errors.values()) < 1e-5, errors
