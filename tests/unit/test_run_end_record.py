"""The final checkpoint's record of how its run ended (``run_end`` in trainer.json), what a resume of
it says instead of training, and the phase boundaries of an evaluation in one process."""

import json
from dataclasses import dataclass

import pytest

from trainer import failpoints
from trainer.checkpoint.checkpoint_files import (
    TRAINER_FILE,
    checkpoint_damage,
    complete_checkpoints,
    read_trainer_meta,
    write_manifest,
)
from trainer.checkpoint.components import FieldsState
from trainer.checkpoint.run_end import finished_run_note, record_run_end
from trainer.evaluation.phase_agreement import EvaluationPhases

META = {"epoch": 3, "step_in_epoch": 0, "global_step": 6, "world_size": 2}


@pytest.fixture
def checkpoint(tmp_path):
    """A complete checkpoint as far as the record is concerned: a file, its manifest, trainer.json."""
    path = tmp_path / "checkpoints" / "step_000000006"
    path.mkdir(parents=True)
    (path / "model.pt").write_bytes(b"weights")
    write_manifest(path)
    (path / TRAINER_FILE).write_text(json.dumps(META))
    return path


def test_the_record_is_added_to_trainer_json_and_leaves_the_checkpoint_complete(checkpoint):
    record_run_end(checkpoint, "running")
    record_run_end(checkpoint, "failed", "RuntimeError: boom")
    meta = read_trainer_meta(checkpoint)
    assert meta == dict(META, run_end={"finished": True, "evaluation": "failed", "cause": "RuntimeError: boom"})
    assert checkpoint_damage(checkpoint) is None and complete_checkpoints(checkpoint.parent) == [checkpoint]
    assert sorted(p.name for p in checkpoint.iterdir()) == ["manifest.json", "model.pt", TRAINER_FILE]


@dataclass
class _Position:
    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0


def test_a_recorded_trainer_json_still_loads_the_trainers_position(checkpoint):
    record_run_end(checkpoint, "done")
    position = _Position()
    FieldsState(position).load_state_dict(read_trainer_meta(checkpoint))
    assert position == _Position(3, 0, 6)


@pytest.mark.parametrize("evaluation, says", [
    ("done", "its end-of-run evaluation ran (the scores are in its logs)"),
    ("failed", "its end-of-run evaluation failed (RuntimeError: boom) and is not run again"),
    ("running", "its end-of-run evaluation did not finish (the job stopped during it) and is not run again"),
    ("off", "it had no end-of-run evaluation"),
])
def test_a_resume_of_a_finished_run_says_so_in_one_line(checkpoint, evaluation, says):
    record_run_end(checkpoint, evaluation, "RuntimeError: boom" if evaluation == "failed" else None)
    note = finished_run_note(checkpoint, read_trainer_meta(checkpoint), epochs=3)
    assert note.startswith(f"{checkpoint} is the final checkpoint of a finished run (epoch 3, step 6): nothing to "
                           f"train; {says}; score it with `instcls eval knn|linear --checkpoint auto`"), note
    assert "\n" not in note


def test_a_resume_with_epochs_left_or_of_an_older_checkpoint_trains_as_before(checkpoint):
    assert finished_run_note(checkpoint, read_trainer_meta(checkpoint), epochs=3) is None  # no record: older
    record_run_end(checkpoint, "done")
    assert finished_run_note(checkpoint, read_trainer_meta(checkpoint), epochs=4) is None  # optim.epochs raised
    assert finished_run_note(None, None, epochs=3) is None  # a fresh start


def test_one_process_phases_raise_the_error_and_fire_the_fail_point_after_their_work(monkeypatch):
    phases = EvaluationPhases(None, "eval.end_of_run", fail_at="gather")
    assert phases.run("knn", lambda: 7) == 7
    with pytest.raises(ZeroDivisionError):
        phases.run("features", lambda: 1 / 0)
    assert phases.run("gather", lambda: "gathered") == "gathered"  # not armed
    monkeypatch.setattr(failpoints, "_ARMED", ("eval.end_of_run", None, None))
    done = []
    with pytest.raises(RuntimeError, match="fail point eval.end_of_run: .* after its gather phase"):
        phases.run("gather", lambda: done.append("gathered"))
    assert done == ["gathered"]  # the phase's work ran first: the failure comes after its collectives
    assert phases.run("knn", lambda: 7) == 7
