"""A forked loader worker never finalises what it inherited: an unreachable object of the parent (a
DALI pipeline of an earlier loader, whose finaliser waits for threads the child does not have) is
finalised in the parent only, and the torch loader forks its workers that way."""

from __future__ import annotations

import gc
import multiprocessing
import os
from pathlib import Path

from data_pipeline.loading.fork_guard import children_leave_inherited_objects_alone


class _Finalised:
    """Writes the pid of the process that finalises it; kept in a cycle so only the collector frees it."""

    def __init__(self, log: Path) -> None:
        self.log, self.me = log, self

    def __del__(self) -> None:
        with open(self.log, "a") as out:
            out.write(f"{os.getpid()}\n")


def _collect_in_child(ready) -> None:
    gc.collect()
    ready.put(os.getpid())


def _finalised_by(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def _fork_and_collect(log: Path, guarded: bool) -> int:
    # The parent's own garbage first (an earlier test's DALI pipelines): an unguarded child would hang
    # finalising them; then the cycle below must survive until the child collects.
    gc.collect()
    gc.disable()
    try:
        _Finalised(log)
        context = multiprocessing.get_context("fork")
        ready = context.Queue()
        child = context.Process(target=_collect_in_child, args=(ready,))
        if guarded:
            with children_leave_inherited_objects_alone():
                child.start()
        else:
            child.start()
        pid = ready.get(timeout=60)
        child.join(60)
        return pid
    finally:
        gc.enable()
        gc.collect()


def test_a_child_forked_inside_the_guard_leaves_the_inherited_garbage_to_the_parent(tmp_path):
    unguarded = _fork_and_collect(tmp_path / "unguarded.log", guarded=False)
    assert unguarded in _finalised_by(tmp_path / "unguarded.log"), "the hazard: the child finalised its copy"
    child = _fork_and_collect(tmp_path / "guarded.log", guarded=True)
    assert _finalised_by(tmp_path / "guarded.log") == [os.getpid()] and child != os.getpid()
    assert gc.get_freeze_count() == 0, "the parent collects its own objects again after the fork"


def test_the_torch_loader_forks_its_workers_inside_the_guard(color_shards, monkeypatch):
    import torch

    from data_pipeline.loading.augment.augment_config import AugmentConfig
    from data_pipeline.loading.loader import build_loader
    from data_pipeline.loading.loader_config import LoaderConfig

    frozen_at_start = []
    original = multiprocessing.process.BaseProcess.start

    def recorded(process):
        frozen_at_start.append(gc.get_freeze_count())
        return original(process)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recorded)
    config = LoaderConfig(batch_size=8, backend="torch", num_threads=2, augment=AugmentConfig(image_size=16))
    loader = build_loader(color_shards, config, rank=0, world_size=1, device=torch.device("cpu"), train=True)
    next(iter(loader.epoch_batches(0)))
    assert len(frozen_at_start) == 2 and min(frozen_at_start) > 0
    assert gc.get_freeze_count() == 0


def test_an_error_leaving_the_loader_stops_its_workers_while_the_traceback_lives(color_shards):
    """A test's ``pytest.raises`` (or a caller's logged exception) keeps the traceback, and with it the
    loader's frame: its worker processes must not live on with it (they hold every fd the parent had,
    which kept a fork server the parent stopped from ever exiting)."""
    import torch

    from data_pipeline.loading.augment.augment_config import AugmentConfig
    from data_pipeline.loading.loader import build_loader
    from data_pipeline.loading.loader_config import LoaderConfig

    config = LoaderConfig(batch_size=8, backend="torch", num_threads=2, augment=AugmentConfig(image_size=16))
    batches = build_loader(color_shards, config, rank=0, world_size=1, device=torch.device("cpu"),
                           train=True).epoch_batches(0)
    next(batches)
    assert len(multiprocessing.active_children()) == 2
    try:
        batches.throw(RuntimeError("a bad sample"))
    except RuntimeError as error:
        kept = error  # the traceback, and the generator's frames, stay referenced
    assert kept.__traceback__ is not None
    assert multiprocessing.active_children() == []
