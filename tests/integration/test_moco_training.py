"""MoCo v2 with CO2 through the real trainer: on 2 CPU ranks a run resumed from its mid-run checkpoint
ends bit-identical to the uninterrupted one (student, momentum teacher, queue), and (slow) a 1-rank run
of the same global batch fills every queue slot with the same sample, its key within the tolerance of
a change of world size (docs/reliability.md: 5e-3 relative)."""

import shutil

import pytest
import torch

from tests.helpers.training import latest_checkpoint, run_train
from tests.integration.test_training import assert_same_training_state
from trainer.checkpoint.row_checkpoint import read_full_rows

pytestmark = pytest.mark.integration

MOCO = "moco_demo_cpu.yaml"
GLOBAL_BATCH, QUEUE = 64, 192  # the queue holds 3 global batches: 4 steps wrap it
# Both encoders' BatchNorm over the whole batch, so 1 and 2 ranks compute the same function.
SETTINGS = ["optim.epochs=4", "optim.warmup_epochs=1", "parallel.deterministic=true", f"objective.queue_size={QUEUE}",
            "objective.co2_alpha=0.3", "model.batch_norm=sync", "checkpoint.every_steps=2", "max_steps=4"]


def _queue(checkpoint):
    rows = read_full_rows(checkpoint / "components" / "objective" / "rows")
    (keys,) = [value for name, value in rows.items() if name.endswith("keys")]
    (ids,) = [value for name, value in rows.items() if name.endswith("ids")]
    return keys, ids


def _teacher(checkpoint):
    return torch.load(checkpoint / "teacher" / "model.pt", weights_only=True)


def test_moco_with_co2_resumes_bit_identically(digits_split, tmp_path):
    uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    run_train(uninterrupted, digits_split, 2, SETTINGS + [f"data.loader.batch_size={GLOBAL_BATCH // 2}"], config=MOCO)
    middle = uninterrupted / "checkpoints" / "step_000000002"
    shutil.copytree(middle, interrupted / "checkpoints" / middle.name)
    run_train(interrupted, digits_split, 2, SETTINGS + [f"data.loader.batch_size={GLOBAL_BATCH // 2}"],
              resume="auto", config=MOCO)
    resumed, reference = latest_checkpoint(interrupted), latest_checkpoint(uninterrupted)
    assert resumed.name == reference.name == "step_000000004"
    assert_same_training_state(resumed, reference)
    for name, tensor in _teacher(reference).items():
        assert torch.equal(tensor, _teacher(resumed)[name]), f"teacher {name} differs"
    keys, ids = _queue(reference)
    resumed_keys, resumed_ids = _queue(resumed)
    assert torch.equal(keys, resumed_keys) and torch.equal(ids, resumed_ids)
    # 4 steps of 64 keys in 192 slots: the 4th step's keys overwrote the 1st's, every slot holds a sample.
    assert keys.shape == (QUEUE, 128) and (ids >= 0).all() and torch.allclose(keys.norm(dim=1), torch.ones(QUEUE))
    assert ids.unique().numel() == QUEUE  # 256 draws of an epoch's permutation: no sample twice


# Default suite: the gathered keys land in the single-process slots on 2 ranks (test_queue_multirank.py).
@pytest.mark.slow
def test_one_rank_fills_every_slot_with_the_same_sample_as_two(digits_split, tmp_path):
    runs = {}
    for ranks in (2, 1):
        run_train(tmp_path / str(ranks), digits_split, ranks,
                  SETTINGS + [f"data.loader.batch_size={GLOBAL_BATCH // ranks}"], config=MOCO)
        runs[ranks] = _queue(latest_checkpoint(tmp_path / str(ranks)))
    (keys, ids), (one_keys, one_ids) = runs[2], runs[1]
    assert (ids >= 0).all()
    assert torch.equal(one_ids, ids), "which sample's key sits in which slot depends on the ranks"
    torch.testing.assert_close(one_keys, keys, rtol=5e-3, atol=5e-3)
