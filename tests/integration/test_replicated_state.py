"""State every rank must hold alike: BatchNorm's running statistics averaged over 2 gloo ranks
(against the mean of what each rank held), and the digest comparison that names what differs."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainer.engine.replicated_state import diverged_entries, replicated_digests
from trainer.models import ModelConfig
from trainer.parallel import init_distributed
from trainer.parallel.batch_norm import apply_batch_norm_mode, averaged_running_statistics, running_statistics
from trainer.parallel.launch import spawn_local_workers
from trainer.parallel.sharded_state import ShardedRows
from trainer.parallel.sync_batch_norm import SyncBatchNorm

pytestmark = pytest.mark.integration


def _network() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
                         nn.BatchNorm1d(5))


class _Component:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def _check_running_statistics_and_digests():
    dims = init_distributed()
    group = dims.data_parallel_group
    model = _network().train()
    generator = torch.Generator().manual_seed(10 + dims.rank)  # each rank its own batches
    for _ in range(3):
        model(torch.randn(6, 3, 8, 8, generator=generator) * (1 + dims.rank))
    before = [t.clone() for t in running_statistics(model).values()]
    assert list(running_statistics(model)) == ["1.running_mean", "1.running_var", "4.running_mean", "4.running_var"]
    every_rank = [[torch.empty_like(t) for _ in range(dims.world_size)] for t in before]
    for gathered, mine in zip(every_rank, before):
        dist.all_gather(gathered, mine, group=group)
    expected_spread = max(float((torch.stack(g).max(0).values - torch.stack(g).min(0).values).max())
                          for g in every_rank)
    assert expected_spread > 0.01  # the ranks really drifted apart

    # Digests before the averaging name exactly the drifted buffers; a sharded part is left out.
    def digests(model):
        own_rows = ShardedRows(torch.full((2, 3), float(dims.rank)), 2 * dims.rank, 2 * dims.rank + 2, 4)
        return replicated_digests(model, {"objective": _Component({"rows": own_rows, "count": 7}),
                                          "rng": _Component({"state": dims.rank})}, parameters_whole=True)

    drifted = diverged_entries(digests(model), dims.control_group)
    assert drifted == ["model.1.running_mean", "model.1.running_var", "model.4.running_mean", "model.4.running_var"]

    averaged, spread = averaged_running_statistics(model, group)
    assert spread == pytest.approx(expected_spread, rel=1e-6)
    for gathered, average in zip(every_rank, averaged.values()):
        torch.testing.assert_close(average, torch.stack(gathered).double().mean(0).float(), rtol=1e-6, atol=1e-7)
    for own, now in zip(before, running_statistics(model).values()):
        assert torch.equal(own, now)  # each rank keeps its own: the average is what is saved and scored
    # Every rank holds the same average; with the per-rank statistics left out the rest agrees.
    agreed = replicated_digests(model, {}, parameters_whole=True, per_rank_buffers=set(averaged), network=averaged)
    assert "network.1.running_mean" in agreed and "model.1.running_mean" not in agreed
    assert diverged_entries(agreed, dims.control_group) == []
    # A planted difference in a plain value is named; so is a name only one rank has.
    planted = agreed | {k: v for k, v in digests(model).items() if k.startswith("objective")}
    planted["objective.count"] = planted["objective.count"] + str(dims.rank)
    if dims.rank == 1:
        planted["objective.extra"] = "x"
    assert diverged_entries(planted, dims.control_group) == ["objective.count", "objective.extra"]


def test_running_statistics_are_averaged_and_divergence_is_named():
    spawn_local_workers(_check_running_statistics_and_digests, 2)


def test_sync_batch_norm_converts_on_cpu_ranks_and_is_checked_in_the_config():
    model = _network()
    assert apply_batch_norm_mode(model, "local", None) is model
    converted = apply_batch_norm_mode(_network(), "sync", None)  # gloo ranks too
    assert sum(isinstance(m, SyncBatchNorm) for m in converted.modules()) == 2
    assert converted.state_dict().keys() == model.state_dict().keys()  # checkpoints load in either mode
    with pytest.raises(ValueError, match="batch_norm='shared' is invalid"):
        ModelConfig(batch_norm="shared")
