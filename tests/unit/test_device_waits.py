"""``DeviceWaitCounter`` counts one wait per synchronising call asked for, where it was asked for.

On CUDA, DeepSpeed's accelerator's ``synchronize`` calls ``torch.cuda.synchronize``, and the counter
wraps both: the inner call must not be counted a second time.  Here the outer call is DeepSpeed's
real ``CUDA_Accelerator.synchronize`` and the inner one a plain function standing in for
``torch.cuda.synchronize``, so the stack runs on a machine without a GPU."""

from __future__ import annotations

import importlib
import threading

import torch

from trainer.dry_run.device_waits import DeviceWaitCounter
from trainer.parallel.deepspeed_import import deepspeed


def _cuda_accelerator(monkeypatch, inner):
    """DeepSpeed's CUDA accelerator as ``get_accelerator()``'s answer, over ``inner`` as ``torch.cuda.synchronize``."""
    monkeypatch.setattr(torch.cuda, "synchronize", inner)
    # deepspeed_import, imported above, has named the accelerator before this submodule is loaded
    accelerator = importlib.import_module("deepspeed.accelerator.cuda_accelerator").CUDA_Accelerator()
    monkeypatch.setattr(deepspeed, "get_accelerator", lambda: accelerator)
    return accelerator


def test_the_accelerator_wait_is_counted_once_and_a_direct_torch_wait_once(monkeypatch):
    made = []
    accelerator = _cuda_accelerator(monkeypatch, lambda device=None: made.append(device))
    sites: list[str] = []
    with DeviceWaitCounter(sink=sites) as waits:
        accelerator.synchronize()
        accelerator.synchronize(0)
        torch.cuda.synchronize()
    assert made == [None, 0, None], "every wait still reaches the device"
    assert [wait.call for wait in waits.records] == ["CUDA_Accelerator.synchronize"] * 2 + ["torch.cuda.synchronize"]
    assert all("test_device_waits.py" in wait.where for wait in waits.records), waits.records
    assert len(sites) == 3
    assert "synchronize" not in vars(accelerator), "the wrappers are gone after the block"


def test_a_wait_on_another_thread_inside_an_outer_call_is_still_counted(monkeypatch):
    """Only the nested call on the same thread is skipped: a worker's own wait, made while the
    training thread is inside the accelerator's call, is a wait of its own."""

    def inner(device=None):
        if threading.current_thread() is threading.main_thread():
            worker = threading.Thread(target=torch.cuda.synchronize)
            worker.start()
            worker.join()

    accelerator = _cuda_accelerator(monkeypatch, inner)
    with DeviceWaitCounter() as waits:
        accelerator.synchronize()
    main = threading.get_ident()
    assert [wait.call for wait in waits.on_thread(main)] == ["CUDA_Accelerator.synchronize"]
    assert [wait.call for wait in waits.records if wait.thread != main] == ["torch.cuda.synchronize"]
