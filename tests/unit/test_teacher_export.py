"""`instcls export` hands out the trained student by default and, with ``--teacher``, the momentum
teacher a checkpoint holds (``teacher/model.pt``, its own BatchNorm statistics): the folder says which
network it holds, and a checkpoint without a teacher is refused, naming the fix."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.checkpoints import trained_like, write_checkpoint, write_job
from trainer.checkpoint.teacher_state import TEACHER_FILE
from trainer.cli import main


@pytest.fixture
def run(tmp_path):
    """A ResNet-10 job and one checkpoint of it with a teacher beside the student."""
    path, config = write_job(tmp_path / "run", {"arch": "resnet10", "small_input_stem": True})
    checkpoint = write_checkpoint(config, trained_like(config, seed=0))
    (checkpoint / TEACHER_FILE).parent.mkdir()
    torch.save(trained_like(config, seed=1).state_dict(), checkpoint / TEACHER_FILE)
    return path, checkpoint


def _export(path, checkpoint, out, *flags) -> int:
    return main(["export", "--config", str(path), "--checkpoint", str(checkpoint), "--out", str(out), *flags])


def test_the_student_is_exported_by_default_and_the_teacher_with_the_flag(run, tmp_path, capsys):
    path, checkpoint = run
    assert _export(path, checkpoint, tmp_path / "student") == 0
    assert _export(path, checkpoint, tmp_path / "teacher", "--teacher") == 0
    assert "exported the momentum teacher's backbone of" in capsys.readouterr().out
    student, teacher = torch.load(checkpoint / "model.pt"), torch.load(checkpoint / TEACHER_FILE)
    for name, saved in (("student", student), ("teacher", teacher)):
        weights = load_file(str(tmp_path / name / "model.safetensors"))
        assert torch.equal(weights["conv1.weight"], saved["backbone.conv1.weight"])
        assert torch.equal(weights["bn1.running_var"], saved["backbone.bn1.running_var"])  # its own statistics
        exported = json.loads((tmp_path / name / "config.json").read_text())
        assert exported["instcls"]["checkpoint"]["network"] == name
        assert ("momentum teacher" in (tmp_path / name / "README.md").read_text()) == (name == "teacher")
    assert not torch.equal(student["backbone.conv1.weight"], teacher["backbone.conv1.weight"])


def test_the_teacher_of_a_checkpoint_without_one_is_refused_naming_the_fix(run, tmp_path, capsys):
    path, checkpoint = run
    (checkpoint / TEACHER_FILE).unlink()
    assert _export(path, checkpoint, tmp_path / "out", "--teacher") == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "holds no momentum teacher" in error and "leave out --teacher" in error
    assert not (tmp_path / "out").exists()
