"""Per-sample accounting of the kill drill: the ids each step of the final training consumed, read
from the ranks' logs of every attempt of a restarted job."""

import json

from trainer.drills.jobs import accounting_difference, consumed_ids


def _write_logs(run_dir, attempts_by_rank):
    """``attempts_by_rank``: {rank: [(step, ids), ...]} in the order the attempts logged them."""
    (run_dir / "logs").mkdir(parents=True)
    for rank, records in attempts_by_rank.items():
        lines = [json.dumps({"event": "step", "step": step}) for step, _ in records]
        lines += [json.dumps({"event": "consumed", "epoch": 0, "step": step, "ids": ids}) for step, ids in records]
        (run_dir / "logs" / f"rank-{rank:05d}.jsonl").write_text("\n".join(lines) + "\n")


def test_a_repeated_step_counts_once_from_the_attempt_that_survived(tmp_path):
    reference, restarted = tmp_path / "reference", tmp_path / "restarted"
    _write_logs(reference, {0: [(1, [0, 1]), (2, [4, 5])], 1: [(1, [2, 3]), (2, [6, 7])]})
    # Rank 0 logged step 2 before the kill; the restart from step 1's checkpoint repeated it.
    _write_logs(restarted, {0: [(1, [0, 1]), (2, [4, 5]), (2, [4, 5])], 1: [(1, [2, 3]), (2, [6, 7])]})
    assert consumed_ids(restarted) == {1: [0, 1, 2, 3], 2: [4, 5, 6, 7]}
    assert accounting_difference(restarted, reference) == (None, 8)


def test_a_sample_consumed_twice_or_skipped_is_reported(tmp_path):
    reference = tmp_path / "reference"
    _write_logs(reference, {0: [(1, [0, 1]), (2, [2, 3])]})
    twice = tmp_path / "twice"
    _write_logs(twice, {0: [(1, [0, 1]), (2, [1, 3])]})
    problem, _ = accounting_difference(twice, reference)
    assert problem == "step 2 consumed other ids than the uninterrupted run"
    short = tmp_path / "short"
    _write_logs(short, {0: [(1, [0, 1])]})
    assert accounting_difference(short, reference)[0] == "steps consumed: [1], uninterrupted: [1, 2]"
    repeat = tmp_path / "repeat"
    _write_logs(repeat, {0: [(1, [0, 0]), (2, [2, 3])]})
    _write_logs(tmp_path / "reference_repeat", {0: [(1, [0, 0]), (2, [2, 3])]})
    assert accounting_difference(repeat, tmp_path / "reference_repeat") == ("1 ids consumed more than once", 4)


def test_after_a_shrink_a_step_counts_from_the_run_that_trained_it_last(tmp_path):
    """Rank 1 of the 2-rank run logged step 2 before its peer's node was lost; the 1-rank run after
    the restart trained step 2 again with the whole global batch.  Rank 1's stale record is not
    added to it: the step's ids are the last run's (its token)."""
    reference = tmp_path / "reference"
    _write_logs(reference, {0: [(1, [0, 1]), (2, [4, 5])], 1: [(1, [2, 3]), (2, [6, 7])]})
    shrunk = tmp_path / "shrunk" / "logs"
    shrunk.mkdir(parents=True)

    def consumed(time, run, step, ids):
        return json.dumps({"time": time, "event": "consumed", "run": run, "step": step, "ids": ids})

    (shrunk / "rank-00000.jsonl").write_text("\n".join([
        consumed(1.0, "a", 1, [0, 1]), consumed(5.0, "b", 2, [4, 5, 6, 7])]) + "\n")
    (shrunk / "rank-00001.jsonl").write_text("\n".join([
        consumed(1.1, "a", 1, [2, 3]), consumed(2.0, "a", 2, [6, 7])]) + "\n")
    assert consumed_ids(shrunk.parent) == {1: [0, 1, 2, 3], 2: [4, 5, 6, 7]}
    assert accounting_difference(shrunk.parent, reference) == (None, 8)
