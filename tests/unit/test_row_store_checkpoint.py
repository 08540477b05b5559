"""A disk row store is saved and loaded without copying its rows through anonymous memory, also by
an asynchronous save, whose snapshot goes to a file beside the store."""

import threading

import pytest
import torch

from trainer.checkpoint.async_checkpoint import AsyncCheckpointer
from trainer.checkpoint.components import load_component, save_component
from trainer.checkpoint.save_plan import FileWrite
from trainer.objectives import ObjectiveContext, OptimSettings, PicConfig, PicObjective
from trainer.observability.memory import status_field_bytes
from trainer.parallel import single_process_dims

ROWS, DIM = 200_000, 128  # 98 MiB per array
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _rss_anon() -> int:
    return status_field_bytes("RssAnon")


def _objective(directory, seed):
    return PicObjective(PicConfig(row_store="disk", row_store_dir=str(directory), queue_size=16),
                        ObjectiveContext(dims=single_process_dims(), num_instances=ROWS, feature_dim=DIM, seed=seed,
                                         optim=OptimSettings(momentum=0.9, weight_decay=1e-4)))


def test_disk_store_checkpoints_stream_through_the_page_cache(tmp_path):
    saved = _objective(tmp_path / "store-a", seed=1)
    (tmp_path / "ckpt" / "components" / "objective").mkdir(parents=True)
    before = _rss_anon()
    save_component(tmp_path / "ckpt", "objective", saved, single_process_dims())
    assert _rss_anon() - before < 40 * 2**20

    loaded = _objective(tmp_path / "store-b", seed=2)  # other initial rows: all must come from the file
    before = _rss_anon()
    load_component(tmp_path / "ckpt", "objective", loaded, single_process_dims(), torch.device("cpu"))
    assert _rss_anon() - before < 40 * 2**20
    assert torch.equal(loaded.store.weight, saved.store.weight)
    assert torch.equal(loaded.store.momentum, saved.store.momentum)
    assert not torch.equal(loaded.store.weight[:10], _objective(tmp_path / "store-c", seed=2).store.weight[:10])


class _Gate:
    """A checkpoint entry whose file is written once ``opened`` is set: holds the writer thread."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def snapshot(self, path, dims, step):
        return [FileWrite("gate.pt", {}, owned=True, save=self._save)]

    def _save(self, payload, file) -> None:
        assert self.opened.wait(timeout=60)
        torch.save(payload, file)

    def load_from(self, path, dims) -> None:
        pass


def test_an_asynchronous_save_snapshots_a_disk_store_beside_it_not_in_memory(tmp_path):
    saved, gate = _objective(tmp_path / "store-a", seed=1), _Gate()
    rows_at_save = saved.store.rows[:10].clone()
    checkpointer = AsyncCheckpointer(tmp_path / "checkpoints", single_process_dims(), keep_last=1)
    try:
        before = _rss_anon()
        checkpointer.save(1, {"gate": gate, "objective": saved})
        assert _rss_anon() - before < 40 * 2**20
        assert (tmp_path / "store-a" / "rank-00000" / "checkpoint-snapshot-rows.bin").is_file()
        saved.store.rows[:10] += 1  # training goes on while the writer waits
        gate.opened.set()
        path = checkpointer.wait()
    finally:
        checkpointer.close()
    loaded = _objective(tmp_path / "store-b", seed=2)
    load_component(path, "objective", loaded, single_process_dims(), torch.device("cpu"))
    assert torch.equal(loaded.store.rows[:10], rows_at_save)
    assert torch.equal(loaded.store.rows[10:], saved.store.rows[10:])
