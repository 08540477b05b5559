"""A job resumed on fewer ranks, as after a node lost for good, with the job's config unchanged:
it keeps the checkpoint's global batch (2 x 64 -> 1 x 128), so the sampler reads the same samples
at every step and the schedule is the same, and it records what the restart cost."""

import json
import shutil

import pytest

from tests.helpers.training import FAST, latest_checkpoint, run_train

pytestmark = pytest.mark.integration

# 16 px views: what is checked (samples read, schedule, restart record) does not depend on the image size,
# and a step of the 32 px network costs four times as much.
LOGGED = [*FAST, "logging.log_every=1", "logging.consumed_ids=true", "checkpoint.every_steps=2",
          "data.loader.augment.image_size=16"]


def _records(run_dir, rank=0):
    return [json.loads(line) for line in (run_dir / "logs" / f"rank-{rank:05d}.jsonl").read_text().splitlines()]


@pytest.mark.slow  # default suite: checkpoints resumed on other world sizes by the checkpoint and engine code in
# test_backbone_optimizer_reshard.py and test_bf16_master_weights.py; the global batch split and the restart's
# cost in tests/unit/test_elastic.py
def test_a_resume_on_fewer_ranks_keeps_the_global_batch_and_records_the_restart(digits_split, tmp_path):
    elastic, reference = tmp_path / "elastic", tmp_path / "reference"
    # The uninterrupted 2-rank run to step 4 is also the reference: its logs are kept as they were
    # before the resume on 1 rank redoes steps 3-4 (one job less to run than a separate reference).
    run_train(elastic, digits_split, 2, [*LOGGED, "max_steps=4"])  # steps 1-4, checkpoints at 2 and 4 (the end)
    shutil.copytree(elastic / "logs", reference / "logs")
    checkpoint = elastic / "checkpoints" / "step_000000002"
    (latest_checkpoint(elastic) / "trainer.json").unlink()  # step 4's save lost with the node: 2 steps to redo
    result = run_train(elastic, digits_split, 1, [*LOGGED, "max_steps=4"], resume="auto")
    assert "global batch 128, the checkpoint's (written by 2 ranks): 1 ranks x 128 images" in result.stderr + \
        result.stdout

    restart = [r for r in _records(elastic) if r["event"] == "restart"]
    assert len(restart) == 1
    assert {k: restart[0][k] for k in ("restarts", "world_size", "previous_world_size", "checkpoint_step",
                                       "last_logged_step", "steps_lost")} == {
        "restarts": 1, "world_size": 1, "previous_world_size": 2, "checkpoint_step": 2, "last_logged_step": 4,
        "steps_lost": 2}
    assert restart[0]["stopped_seconds"] > 0
    meta = json.loads((latest_checkpoint(elastic) / "trainer.json").read_text())
    assert (meta["global_batch"], meta["world_size"], meta["restarts"]) == (128, 1, 1)
    assert json.loads((checkpoint / "trainer.json").read_text())["global_batch"] == 128

    def consumed(run_dir, ranks):
        """step -> the ids every rank consumed at it (the last time it ran)."""
        ids = {}
        for rank in ranks:
            for record in _records(run_dir, rank):
                if record["event"] == "consumed":
                    ids.setdefault(record["step"], {})[rank] = record["ids"]
        return {step: sorted(i for per_rank in by_rank.values() for i in per_rank) for step, by_rank in ids.items()}

    theirs = consumed(reference, (0, 1))
    mine_before, mine_after = consumed(elastic, (0, 1)), consumed(elastic, (0,))
    assert all(mine_before[s] == theirs[s] for s in (1, 2))
    assert all(mine_after[s] == theirs[s] for s in (3, 4)), "the resumed job read other samples"
    lr = {r["step"]: r["lr"] for r in _records(elastic) if r["event"] == "step"}
    assert lr == {r["step"]: r["lr"] for r in _records(reference) if r["event"] == "step"}
