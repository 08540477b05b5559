"""The global batch kept across world sizes, and the cost of a restart read from the run's logs."""

import json

import pytest

from trainer.elastic.global_batch import GlobalBatchError, split_global_batch
from trainer.elastic.restart_cost import TAIL_BYTES, last_logged_step, restart_cost


def test_a_first_start_uses_the_configured_per_rank_batch():
    split = split_global_batch(64, 3)
    assert (split.global_batch, split.per_rank, split.changed) == (192, 64, False)


@pytest.mark.parametrize("world,per_rank", [(1, 128), (2, 64), (4, 32), (8, 16)])
def test_a_resume_splits_the_checkpoints_global_batch_over_the_ranks_it_has(world, per_rank):
    split = split_global_batch(64, world, saved_global_batch=128, saved_world_size=2)
    assert split.per_rank * world == split.global_batch == 128
    assert split.per_rank == per_rank and split.changed == (per_rank != 64)
    assert f"{world} ranks x {per_rank} images" in split.describe()


def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_with_the_ones_that_do():
    with pytest.raises(GlobalBatchError, match=r"cannot resume on 3 ranks: the job's global batch 128 .* \(the "
                                               r"nearest: 2 or 4\)") as refused:
        split_global_batch(64, 3, saved_global_batch=128, saved_world_size=2)
    assert isinstance(refused.value, ValueError)  # exits BAD_INPUT: the same attempt would fail again


def _write_log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_restart_cost_counts_steps_past_the_checkpoint_on_any_rank(tmp_path):
    _write_log(tmp_path / "rank-00000.jsonl", [
        {"time": 10.0, "event": "start"}, {"time": 11.0, "event": "step", "step": 1},
        {"time": 12.0, "event": "step", "step": 2}, {"time": 13.0, "event": "message", "message": "saved"}])
    _write_log(tmp_path / "rank-00001.jsonl", [
        {"time": 12.1, "event": "step", "step": 2}, {"time": 14.5, "event": "step", "step": 3}])
    (tmp_path / "rank-00001.jsonl").open("a").write('{"time": 15.0, "event": "st')  # a killed rank's last line
    cost = restart_cost(tmp_path, now=20.0, checkpoint_meta={"global_step": 2, "world_size": 2}, world_size=1)
    assert (cost.last_logged_step, cost.steps_lost, cost.stopped_seconds) == (3, 1, 5.5)
    assert (cost.restarts, cost.previous_world_size, cost.world_size) == (1, 2, 1)
    assert "2 -> 1 ranks; 1 steps lost since the checkpoint at step 2" in cost.describe()
    again = restart_cost(tmp_path, 20.0, {"global_step": 3, "world_size": 1, "restarts": 1}, 2)
    assert (again.steps_lost, again.restarts) == (0, 2)


def test_only_the_tail_of_a_long_log_is_read(tmp_path):
    filler = [{"time": 1.0, "event": "step", "step": 10 ** 6, "pad": "x" * 200}]
    late = [{"time": 2.0, "event": "step", "step": s} for s in range(5)]
    path = tmp_path / "rank-00000.jsonl"
    _write_log(path, filler + [{"time": 1.5, "event": "message", "pad": "y" * 200}] * (TAIL_BYTES // 200) + late)
    assert last_logged_step(tmp_path) == (4, 2.0)  # the early record is beyond the tail


def test_a_batch_changed_on_the_same_ranks_is_refused_not_replaced():
    """On the checkpoint's own world size a new data.loader.batch_size is the user's change of batch:
    it used to be replaced in silence by the checkpoint's; a change of world size still splits it."""
    with pytest.raises(GlobalBatchError, match=r"data.loader.batch_size=32 \(a global batch of 64\).*these same 2 "
                                               r"ranks with a global batch of 128.*Set data.loader.batch_size=64 "
                                               r"to resume, or start a new run"):
        split_global_batch(32, 2, saved_global_batch=128, saved_world_size=2)
    assert split_global_batch(32, 4, saved_global_batch=128, saved_world_size=2).per_rank == 32  # elastic: kept
    # An elastic range fixes the batch at its largest size: 5 of 8 ranks split the same 8 x 16.
    assert split_global_batch(16, 5, saved_global_batch=80, saved_world_size=5, largest_world_size=5).per_rank == 16
    with pytest.raises(GlobalBatchError, match=r"Set data.loader.batch_size=16 to resume"):
        split_global_batch(8, 4, saved_global_batch=128, saved_world_size=4, largest_world_size=8)
