"""A disk row store is saved and loaded without copying its rows through anonymous memory."""

import torch

from trainer.engine.checkpoint import load_component, save_component
from trainer.objectives import ObjectiveContext, OptimSettings, PicConfig, PicObjective
from trainer.observability.memory import status_field_bytes
from trainer.parallel import single_process_dims

ROWS, DIM = 200_000, 128  # 98 MiB per array


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
