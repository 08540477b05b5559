"""The threads that can touch CUDA (PIC's prefetch, the checkpoint writer) run on their rank's GPU:
CUDA's current device is per thread and starts at 0, so without set_device every local rank would
build a CUDA context on GPU 0.  CUDA is faked."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from data_pipeline.loading.view_layout import ViewLayout
from trainer.checkpoint import async_checkpoint
from trainer.checkpoint.components import FieldsState
from trainer.objectives import ObjectiveContext, OptimSettings, build_objective
from trainer.objectives.pic import objective as pic_module
from trainer.objectives.pic.objective import PicConfig
from trainer.parallel import single_process_dims
from trainer.parallel.device_threads import device_thread_pool


def record_set_device(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append((threading.current_thread().name, torch.device(device))))
    return calls


def test_the_pool_thread_sets_the_rank_device_before_any_work(monkeypatch):
    calls = record_set_device(monkeypatch)
    pool = device_thread_pool(torch.device("cuda", 3), "pic-prefetch")
    seen = pool.submit(lambda: (threading.current_thread().name, list(calls))).result()
    pool.shutdown()
    assert seen[0].startswith("pic-prefetch") and seen[1] == [(seen[0], torch.device("cuda", 3))]


def test_cpu_threads_leave_cuda_alone(monkeypatch):
    calls = record_set_device(monkeypatch)
    pool = device_thread_pool(torch.device("cpu"), "pic-prefetch")
    pool.submit(lambda: None).result()
    pool.shutdown()
    assert calls == []


def test_pic_builds_its_prefetch_pool_on_the_rank_device(monkeypatch):
    built = []
    monkeypatch.setattr(pic_module, "device_thread_pool",
                        lambda device, name: built.append((device, name)) or device_thread_pool(device, name))
    dims = single_process_dims(torch.device("cpu"))
    context = ObjectiveContext(dims=dims, num_instances=20, feature_dim=4, seed=0, optim=OptimSettings(0.9, 0.0),
                               views=ViewLayout(("global",) * 2, (32,) * 2))
    build_objective(PicConfig(queue_size=4, prefetch=True), context)
    assert built == [(dims.device, "pic-prefetch")]


def test_the_checkpoint_writer_sets_the_rank_device_before_it_writes(monkeypatch, tmp_path):
    """DCP's file writer synchronises the writer thread's current stream: it must be cuda:3's."""
    calls = record_set_device(monkeypatch)
    writes = []
    write_plan = async_checkpoint.write_plan

    def recording_write_plan(*args, **kwargs):
        writes.append((threading.current_thread().name, list(calls)))
        return write_plan(*args, **kwargs)

    monkeypatch.setattr(async_checkpoint, "write_plan", recording_write_plan)
    # a blocking save never stages; the real stager wants a driver for its pinned buffers
    monkeypatch.setattr(async_checkpoint, "HostStager", lambda device: SimpleNamespace(close=lambda: None))
    position = SimpleNamespace(global_step=1)
    async_checkpoint.save_checkpoint(tmp_path, 1, {"trainer": FieldsState(position)},
                                     single_process_dims(torch.device("cuda", 3)), keep=1)
    [(thread, set_before_writing)] = writes
    assert thread.startswith("instcls-checkpoint-writer")
    assert set_before_writing == [(thread, torch.device("cuda", 3))]
