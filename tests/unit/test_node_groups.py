"""Node groups follow torchrun's numbering (node by node, the same number of ranks on every node) and
refuse a layout without it, naming the setting and the fix; the config refuses a node group without
``batch_norm: sync``."""

import pytest

from trainer.models import ModelConfig
from trainer.parallel.node_groups import ranks_per_node


def test_ranks_per_node_reads_torchrun_s_numbering(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("GROUP_RANK", "2")
    assert ranks_per_node(64, 19, "model.sync_batch_norm_group=node") == 8


@pytest.mark.parametrize("world, rank, local_rank, local_world, node", [
    (12, 5, 1, 8, 0),    # 12 ranks are not nodes of 8
    (16, 12, 3, 8, 1),   # rank 12 on node 1 would be local rank 4: nodes of unequal sizes
])
def test_a_layout_without_equal_nodes_is_refused(monkeypatch, world, rank, local_rank, local_world, node):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("GROUP_RANK", str(node))
    with pytest.raises(ValueError, match=r"model.sync_batch_norm_group=node needs every node .* --nproc-per-node"):
        ranks_per_node(world, rank, "model.sync_batch_norm_group=node")


def test_the_config_refuses_a_node_group_without_sync_batch_norm():
    with pytest.raises(ValueError, match="applies to batch_norm: sync only"):
        ModelConfig(arch="resnet10", sync_batch_norm_group="node")
    with pytest.raises(ValueError, match="sync_batch_norm_group='rack' is invalid"):
        ModelConfig(arch="resnet10", batch_norm="sync", sync_batch_norm_group="rack")
    assert ModelConfig(arch="resnet10", batch_norm="sync", sync_batch_norm_group="node").sync_batch_norm_group == "node"
