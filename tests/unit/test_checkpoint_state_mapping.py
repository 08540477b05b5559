"""A checkpoint is one mapping of entries, saved and restored in its order (``engine.checkpoint``):
the ``trainer`` entry as trainer.json, a ``Stateful`` rank by rank, the RNG from its own files or,
on another world size, reseeded from the position restored before it."""

import json
from dataclasses import dataclass

import torch

from tests.helpers.checkpoint_state import RowTable
from trainer.checkpoint import FieldsState, load_checkpoint, save_checkpoint
from trainer.checkpoint.rng_state import RngState, reseed
from trainer.parallel import single_process_dims

DIMS = single_process_dims(torch.device("cpu"))


@dataclass
class Position:
    epoch: int = 0
    global_step: int = 0


def _checkpoint_state(position: Position, table: RowTable) -> dict:
    return {"trainer": FieldsState(position, num_instances=4), "table": table, "rng": RngState(7, position)}


def _saved(tmp_path):
    position, table = Position(epoch=1, global_step=5), RowTable(torch.arange(8.0).view(4, 2))
    torch.manual_seed(3)
    path = save_checkpoint(tmp_path, 5, _checkpoint_state(position, table), DIMS, keep=1)
    return path, table.rows.clone(), torch.rand(3)


def test_every_entry_comes_back_into_the_same_objects(tmp_path):
    path, rows, next_draw = _saved(tmp_path)
    assert json.loads((path / "trainer.json").read_text()) == {
        "epoch": 1, "global_step": 5, "num_instances": 4, "world_size": 1, "classifier_parallel_size": 1}
    position, table = Position(), RowTable(torch.zeros(4, 2))
    torch.manual_seed(99)
    load_checkpoint(path, _checkpoint_state(position, table), DIMS)
    assert position == Position(epoch=1, global_step=5)
    assert torch.equal(table.rows, rows)
    assert torch.equal(torch.rand(3), next_draw)


def test_on_another_world_size_the_rng_is_reseeded_at_the_restored_step(tmp_path):
    path, _, _ = _saved(tmp_path)
    meta = json.loads((path / "trainer.json").read_text())
    (path / "trainer.json").write_text(json.dumps(dict(meta, world_size=2)))
    reseed(7, 5, 0)
    expected = torch.rand(3)
    position = Position()
    load_checkpoint(path, _checkpoint_state(position, RowTable(torch.zeros(4, 2))), DIMS)
    assert position.global_step == 5 and torch.equal(torch.rand(3), expected)
