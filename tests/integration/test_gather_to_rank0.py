"""The linear probe's input lands in rank 0's host memory only (no other rank holds the whole bank):
2 gloo ranks with uneven rows, gathered in blocks smaller than a rank's share."""

import pytest
import torch

from trainer.evaluation.features import LocalFeatures, gather_to_rank0_host
from trainer.parallel import init_distributed
from trainer.parallel.collectives import object_from_rank0
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

IDS = {0: [0, 3, 4, 7, 9], 1: [1, 2, 8]}  # uneven, interleaved, each rank's ascending


def _rows(ids: list[int]) -> LocalFeatures:
    ids_tensor = torch.tensor(ids)
    features = torch.stack([torch.full((3,), float(i)) + torch.arange(3.0) / 10 for i in ids])
    return LocalFeatures(features.half(), ids_tensor % 4, ids_tensor)


def _check():
    dims = init_distributed()
    gathered = gather_to_rank0_host(_rows(IDS[dims.rank]), dims, block_rows=2)
    if dims.rank == 0:
        everything = sorted(IDS[0] + IDS[1])
        expected = _rows(everything)
        assert gathered.features.dtype == torch.float32 and torch.equal(gathered.features, expected.features.float())
        assert torch.equal(gathered.labels, expected.labels) and torch.equal(gathered.ids, torch.tensor(everything))
    else:
        assert gathered is None  # nothing beyond its own rows
    assert object_from_rank0({"accuracy": 0.5 + dims.rank}, dims.control_group) == {"accuracy": 0.5}


def test_only_rank0_holds_the_gathered_features_and_shares_its_result():
    spawn_local_workers(_check, 2)
