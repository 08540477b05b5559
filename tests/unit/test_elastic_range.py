"""An elastic launch's whole range is checked when the job starts: `instcls launch --nnodes MIN:MAX`
hands the ranks its world sizes, and a global batch (or SwAV's queue) that one of them cannot split is
refused before step 1, naming the nearest global batch every size splits, the per-rank batch to set
and the memory check at the smallest size."""

from __future__ import annotations

import pytest

from trainer.config import load_job_config
from trainer.elastic.global_batch import GlobalBatchError
from trainer.elastic.world_range import check_elastic_range, nearest_common_multiple
from trainer.engine.resumed_settings import settings_for_this_run
from trainer.parallel.elastic_range import WORLD_SIZES_ENV, world_sizes_from_environment, world_sizes_of_launch
from trainer.parallel.launch import torchrun_environment

REPO_CONFIGS = __import__("pathlib").Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("args, sizes", [
    (["--nnodes", "4:8", "--nproc-per-node", "8"], (32, 40, 48, 56, 64)),
    (["--nnodes=1:3", "--nproc_per_node=1"], (1, 2, 3)),
    (["--nnodes", "2", "--nproc-per-node", "8"], None),  # not elastic
    (["--nnodes", "1:2", "--nproc-per-node", "gpu"], None),  # counted by torchrun: unknown here
])
def test_the_launcher_hands_the_ranks_the_world_sizes_of_its_range(tmp_path, args, sizes):
    assert world_sizes_of_launch(args) == sizes
    environ = torchrun_environment(tmp_path, {}, [*args, "-m", "trainer.cli", "train"])
    assert world_sizes_from_environment(environ) == sizes


def test_kubeflow_s_environment_counts_as_the_range(tmp_path):
    environ = torchrun_environment(tmp_path, {"PET_NNODES": "2:4", "PET_NPROC_PER_NODE": "8"}, ["-m", "x"])
    assert world_sizes_from_environment(environ) == (16, 24, 32)


def test_the_shipped_batch_of_4096_fails_a_4_to_8_node_range_and_6720_passes():
    sizes = (32, 40, 48, 56, 64)
    with pytest.raises(GlobalBatchError) as refused:
        check_elastic_range(4096, sizes, {})
    message = str(refused.value)
    assert "does not split over 40, 48, 56 ranks" in message
    # lcm(32, 40, 48, 56, 64) = 6720, the nearest multiple of it to 4096
    assert "nearest global batch that every size splits is 6720: set data.loader.batch_size=105 (the per-rank " \
           "batch at the largest size, 64 ranks; 210 per rank at the smallest, 32 ranks" in message
    assert "instcls plan --config CONFIG --ranks 32" in message
    check_elastic_range(6720, sizes, {})  # every size splits it
    assert nearest_common_multiple(12000, sizes) == 13440 and nearest_common_multiple(9000, sizes) == 6720


def test_a_one_to_three_node_range_is_refused_at_start_with_the_job_s_config(monkeypatch):
    """1 to 3 nodes of 1 rank: the global batch is data.loader.batch_size at the largest size (33 x 3),
    which 2 ranks cannot split.  A range every size splits starts at any of its sizes with the same
    global batch."""
    config = load_job_config(REPO_CONFIGS / "digits_cpu.yaml", ["data.loader.batch_size=33"])
    monkeypatch.setenv(WORLD_SIZES_ENV, "1,2,3")
    with pytest.raises(GlobalBatchError, match=r"global batch 99 does not split over 2 ranks\. The nearest global "
                                               r"batch that every size splits is 102: set data.loader.batch_size=34"):
        settings_for_this_run(config, 3, None, None)
    config = load_job_config(REPO_CONFIGS / "digits_cpu.yaml", ["data.loader.batch_size=22"])
    monkeypatch.setenv(WORLD_SIZES_ENV, "1,2,4")
    for world_size in (1, 2, 4):  # whatever size the first start has
        split = settings_for_this_run(config, world_size, None, None).split
        assert (split.global_batch, split.per_rank) == (88, 88 // world_size)


def test_swav_s_queue_is_checked_over_the_range(monkeypatch):
    config = load_job_config(REPO_CONFIGS / "swav_in1k_r50.yaml", ["data.loader.batch_size=60"])
    assert config.objective.sizes_split_over_ranks() == {"objective.queue_length": config.objective.queue_length}
    monkeypatch.setenv(WORLD_SIZES_ENV, "32,40,48,56,64")
    with pytest.raises(GlobalBatchError, match=r"objective.queue_length=3840 does not split over 56 ranks: use 6720"):
        settings_for_this_run(config, 64, None, None)
