"""``model.batch_norm: sync`` on gloo CPU ranks with unequal per-rank batches (one rank empty on 3
ranks): forward output, running statistics and the gradients of input, weight and bias equal a
plain float64 BatchNorm over the concatenated batch in one process; the running statistics are
bit-identical on every rank; nothing in the forward or backward waits on a value.  Within nodes
(``model.sync_batch_norm_group: node``, 4 ranks as 2 nodes of 2) the same holds per node: each
node's statistics are its own batch's, and the two nodes' differ."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.data_dependent_ops import DataDependentOps
from tests.helpers.training import FAST, latest_checkpoint, replica_checks, run_train
from trainer.parallel import init_distributed
from trainer.parallel.batch_norm import apply_batch_norm_mode, batch_norm_group, statistics_differ_by_rank
from trainer.parallel.launch import spawn_local_workers
from trainer.parallel.sync_batch_norm import SyncBatchNorm, convert_to_sync_batch_norm

pytestmark = pytest.mark.integration

CHANNELS = 4
TIGHT = dict(rtol=1e-10, atol=1e-10)


def _layer(kind: str, momentum: float | None) -> nn.Module:
    layer = (nn.BatchNorm1d if kind == "1d" else nn.BatchNorm2d)(CHANNELS, momentum=momentum).double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    return layer


def _batch(kind: str, rows: int) -> torch.Tensor:
    """Channels with means far from zero, so the combination across ranks is tested where it matters."""
    shape = (rows, CHANNELS) if kind == "1d" else (rows, CHANNELS, 3, 2)
    offsets = torch.tensor([0.0, 5.0, -20.0, 100.0], dtype=torch.float64)
    return torch.randn(shape, dtype=torch.float64) * 2 + offsets.view(1, -1, *([1] * (len(shape) - 2)))


def _summed(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    dist.all_reduce(tensor)
    return tensor


def _check_float64_against_the_concatenated_batch(sizes: list[int], kind: str, momentum: float | None) -> None:
    rank = dist.get_rank()
    start, rows = sum(sizes[:rank]), sizes[rank]
    torch.manual_seed(0)  # the same layer, batches and output weights on every rank
    reference = _layer(kind, momentum)
    layer = convert_to_sync_batch_norm(copy.deepcopy(reference))
    assert isinstance(layer, SyncBatchNorm)
    for _ in range(2):
        full = _batch(kind, sum(sizes))
        output_weights = torch.randn_like(full)
        reference.zero_grad(), layer.zero_grad()
        whole = full.clone().requires_grad_()
        expected = reference(whole)
        (expected * output_weights).sum().backward()

        mine = full[start:start + rows].clone().requires_grad_()
        with DataDependentOps() as found:
            out = layer(mine)
            (out * output_weights[start:start + rows]).sum().backward()
        assert found.ops == []
        torch.testing.assert_close(out, expected[start:start + rows], **TIGHT)
        torch.testing.assert_close(mine.grad, whole.grad[start:start + rows], **TIGHT)
        # each rank's parameter gradient is its share: the data-parallel reduction adds them
        torch.testing.assert_close(_summed(layer.weight.grad), reference.weight.grad, **TIGHT)
        torch.testing.assert_close(_summed(layer.bias.grad), reference.bias.grad, **TIGHT)
        torch.testing.assert_close(layer.running_mean, reference.running_mean, **TIGHT)
        torch.testing.assert_close(layer.running_var, reference.running_var, **TIGHT)
    assert int(layer.num_batches_tracked) == 2
    for statistic in (layer.running_mean, layer.running_var):
        every_rank = [torch.empty_like(statistic) for _ in sizes]
        dist.all_gather(every_rank, statistic)
        assert all(torch.equal(other, statistic) for other in every_rank)  # bit for bit
    layer.eval(), reference.eval()
    probe = _batch(kind, 3)
    torch.testing.assert_close(layer(probe), reference(probe), **TIGHT)


def _check_bf16_parameters_with_fp32_statistics(sizes: list[int]) -> None:
    """DeepSpeed's bf16 engine: bf16 weight and bias, fp32 running statistics, bf16 activations."""
    rank = dist.get_rank()
    start, rows = sum(sizes[:rank]), sizes[rank]
    torch.manual_seed(1)
    reference = _layer("2d", 0.1)
    layer = convert_to_sync_batch_norm(copy.deepcopy(reference).float())
    for parameter in layer.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    full = _batch("2d", sum(sizes)).to(torch.bfloat16).double()  # what both layers see
    expected = reference(full.clone().requires_grad_())
    mine = full[start:start + rows].to(torch.bfloat16).requires_grad_()
    out = layer(mine)
    out.float().sum().backward()
    assert out.dtype == mine.grad.dtype == layer.weight.grad.dtype == torch.bfloat16
    assert layer.running_mean.dtype == torch.float32
    # bf16 weight and bias (rounded once), fp32 arithmetic, bf16 output
    if rows:
        assert (out.double() - expected[start:start + rows]).abs().max() <= 0.03 * expected.abs().max()
    torch.testing.assert_close(layer.running_mean.double(), reference.running_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.running_var.double(), reference.running_var, rtol=1e-5, atol=1e-5)


def _check_every_case(sizes: list[int]) -> None:
    init_distributed()
    for kind in ("1d", "2d"):
        for momentum in (0.1, None):  # None: the cumulative average
            _check_float64_against_the_concatenated_batch(sizes, kind, momentum)
    _check_bf16_parameters_with_fp32_statistics(sizes)


# the 3-rank case (unequal batches, one empty) in the default run; 2 ranks is the same maths
@pytest.mark.parametrize("sizes", [pytest.param([3, 6], marks=pytest.mark.slow), [5, 0, 2]],
                         ids=["2 ranks", "3 ranks, one empty"])
def test_sync_batch_norm_equals_batch_norm_over_the_concatenated_batch(sizes):
    spawn_local_workers(_check_every_case, len(sizes), sizes)


NODE_SIZES = [3, 5, 4, 0]  # rows per rank; ranks 0-1 are node 0, ranks 2-3 node 1 (one rank empty)


def _check_node_groups() -> None:
    dims = init_distributed()
    rank, node = dist.get_rank(), dist.get_rank() // 2
    group = batch_norm_group("sync", "node", dims)
    assert dist.get_world_size(group) == 2 and statistics_differ_by_rank("sync", group, dims)
    assert not statistics_differ_by_rank("sync", batch_norm_group("sync", "world", dims), dims)
    torch.manual_seed(0)  # the same layer and batches on every rank
    reference = _layer("2d", 0.1)
    layer = apply_batch_norm_mode(nn.Sequential(copy.deepcopy(reference)), "sync", group)[0]
    full = torch.cat([_batch("2d", rows) + 10 * (r // 2) for r, rows in enumerate(NODE_SIZES)])  # nodes apart
    output_weights = torch.randn_like(full)
    starts = [sum(NODE_SIZES[:r]) for r in range(len(NODE_SIZES) + 1)]
    node_rows = slice(starts[2 * node], starts[2 * node + 2])  # this node's batch, the reference's input
    whole = full[node_rows].clone().requires_grad_()
    expected = reference(whole)
    (expected * output_weights[node_rows]).sum().backward()
    mine = full[starts[rank]:starts[rank + 1]].clone().requires_grad_()
    out = layer(mine)
    (out * output_weights[starts[rank]:starts[rank + 1]]).sum().backward()
    offset = starts[rank] - starts[2 * node]
    torch.testing.assert_close(out, expected[offset:offset + NODE_SIZES[rank]], **TIGHT)
    torch.testing.assert_close(mine.grad, whole.grad[offset:offset + NODE_SIZES[rank]], **TIGHT)
    torch.testing.assert_close(layer.running_mean, reference.running_mean, **TIGHT)  # the node's own batch
    torch.testing.assert_close(layer.running_var, reference.running_var, **TIGHT)
    every_rank = [torch.empty_like(layer.running_mean) for _ in NODE_SIZES]
    dist.all_gather(every_rank, layer.running_mean)
    assert torch.equal(every_rank[0], every_rank[1]) and torch.equal(every_rank[2], every_rank[3])
    assert not torch.allclose(every_rank[0], every_rank[2])  # the nodes' statistics differ


def test_sync_batch_norm_within_nodes_uses_each_node_s_batch():
    spawn_local_workers(_check_node_groups, len(NODE_SIZES), ranks_per_node=2)


def _check_one_rank_synchronised() -> None:
    import trainer.parallel.sync_batch_norm as sync_module

    init_distributed()
    gathers = []
    original = sync_module.gather_rows
    sync_module.gather_rows = lambda rows, group: gathers.append(rows.shape) or original(rows, group)
    try:
        torch.manual_seed(0)
        reference = _layer("2d", 0.1)
        alone = apply_batch_norm_mode(nn.Sequential(copy.deepcopy(reference)), "sync", None, synchronize_alone=True)
        plain = apply_batch_norm_mode(nn.Sequential(copy.deepcopy(reference)), "sync", None)
        x = _batch("2d", 6)
        expected = reference(x)
        assert gathers == []
        torch.testing.assert_close(plain(x), expected, **TIGHT)
        assert gathers == []  # a group of one: plain BatchNorm
        torch.testing.assert_close(alone(x), expected, **TIGHT)
        assert gathers == [(1, 2 * CHANNELS + 1)]  # the synchronised path, over the group of one
    finally:
        sync_module.gather_rows = original


def test_one_rank_runs_the_synchronised_path_when_asked_and_plain_batch_norm_otherwise():
    """``parallel.collectives_over_one_rank``: a one-GPU check runs the code several ranks run."""
    spawn_local_workers(_check_one_rank_synchronised, 1)


@pytest.mark.slow  # a training run (about a minute); the layer's maths are checked above in seconds
def test_a_two_rank_swav_run_with_sync_batch_norm_trains_under_zero1_with_identical_statistics(
        digits_split, tmp_path):
    """The SwAV recipe's setting (model.batch_norm: sync, ZeRO-1) through the real trainer on gloo CPU
    ranks: every rank's BatchNorm statistics are the same, bit for bit, at every save.  fp32: on CPU
    ranks torch's bf16 convolution returns a garbage weight gradient now and then for the 1 x 1 maps
    of the 16 px crops at layer4 (docs/training.md); the bf16 parameters are checked above."""
    settings = ["model.batch_norm=sync", "deepspeed_config=ds_configs/zero1.json", "max_steps=6",
                "checkpoint.every_steps=3"]
    run_train(tmp_path, digits_split, 2, FAST + settings, config="swav_demo_cpu.yaml")
    for checks in replica_checks(tmp_path, 2):  # every replicated entry agrees, the statistics included
        assert [(c["step"], c["batch_norm_spread"]) for c in checks] == [(3, 0.0), (6, 0.0)]
    checkpoint = latest_checkpoint(tmp_path)
    per_rank = [torch.load(checkpoint / "batch_norm" / f"rank-{r:05d}.pt", weights_only=True) for r in (0, 1)]
    assert len(per_rank[0]) > 10 and all(torch.equal(per_rank[0][k], per_rank[1][k]) for k in per_rank[0])
    assert any(k.endswith("running_var") and not torch.equal(v, torch.ones_like(v)) for k, v in per_rank[0].items())
