"""Every checkpoint carries a manifest (bytes + CRC-32 per file); ``--resume auto`` skips a damaged
newest checkpoint, naming the file, and takes the previous one."""

from __future__ import annotations

import json
import re

import pytest

from trainer.checkpoint.checkpoint_files import checkpoint_damage, resolve_resume, write_manifest


def _checkpoint(directory, step: int):
    path = directory / f"step_{step:09d}"
    (path / "deepspeed" / "state").mkdir(parents=True)
    (path / "deepspeed" / "state" / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 64)
    (path / "model.pt").write_bytes(b"weights" * 1000)
    write_manifest(path)
    (path / "trainer.json").write_text(json.dumps({"global_step": step}))
    return path


def test_an_intact_checkpoint_has_no_damage(tmp_path):
    path = _checkpoint(tmp_path, 10)
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest) == {"deepspeed/state/mp_rank_00_model_states.pt", "model.pt"}
    assert checkpoint_damage(path) is None


@pytest.mark.parametrize("damage,expected", [
    (lambda f: f.write_bytes(f.read_bytes()[:-100]), r"model.pt has 6900 bytes, the manifest says 7000"),
    (lambda f: f.write_bytes(b"W" + f.read_bytes()[1:]), r"model.pt does not match its CRC-32"),
    (lambda f: f.unlink(), r"model.pt is missing"),
])
def test_auto_resume_names_the_damaged_file_and_takes_the_previous(tmp_path, damage, expected):
    older, newest = _checkpoint(tmp_path, 10), _checkpoint(tmp_path, 20)
    damage(newest / "model.pt")
    assert checkpoint_damage(newest) is not None
    said = []
    assert resolve_resume("auto", tmp_path, log=said.append) == older
    assert len(said) == 1 and str(newest) in said[0]
    assert re.search(expected, said[0])
    with pytest.raises(RuntimeError, match="the checkpoint is damaged: .*" + expected):
        resolve_resume(str(newest), tmp_path)


def test_when_every_checkpoint_is_damaged_auto_resume_refuses_to_start_over(tmp_path):
    path = _checkpoint(tmp_path, 10)
    (path / "model.pt").write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"every checkpoint in .* is damaged .*--resume none"):
        resolve_resume("auto", tmp_path, log=lambda message: None)


def test_checkpoints_from_before_manifests_still_resume(tmp_path):
    path = _checkpoint(tmp_path, 10)
    (path / "manifest.json").unlink()
    assert resolve_resume("auto", tmp_path) == path
