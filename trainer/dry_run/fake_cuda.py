"""The CUDA runtime calls a step makes, answered without a driver, for code running on fake tensors.

Fake tensors need no driver, but streams, events, ``set_device`` and pinned memory do.  Inside
``fake_cuda_runtime`` they are stand-ins that do nothing, except that every place the host waits
for the device (``torch.cuda.synchronize``, a stream's or an event's ``synchronize``) is recorded
as a host sync with its source line.  Pinned memory is marked, so a ``non_blocking`` copy from it
is known to be asynchronous.  Work handed to a thread pool runs inline: the fake-tensor mode and
the recorders are per thread, so a pool thread would see neither.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from unittest import mock

import torch

from trainer.dry_run.host_syncs import PINNED, HostSyncRecorder

DEVICE_CAPABILITY = (9, 0)  # what the code asks of the GPU's generation: an H100's
_META_KERNELS = None


def _in_place_ops_without_meta_kernels() -> None:
    """Fake tensors run an op through its meta kernel; the fused SGD update has none and would fall
    back to the real CUDA kernel.  It writes its arguments in place and allocates nothing (the
    momentum buffers are made in Python before it runs), so doing nothing is exact for the dry run.
    Registered once per process, for the meta device only (real tensors never reach it)."""
    global _META_KERNELS
    if _META_KERNELS is not None:
        return
    _META_KERNELS = torch.library.Library("aten", "IMPL")
    for overload in ("_fused_sgd_", "_fused_sgd_.tensor_lr"):
        _META_KERNELS.impl(overload, lambda *args, **kwargs: None, "Meta")


class _Inline:
    """A ``ThreadPoolExecutor`` stand-in that runs each task when it is submitted; the syncs a task
    makes are marked as a worker thread's."""

    recorder: HostSyncRecorder

    def __init__(self, *args, **kwargs) -> None:
        if kwargs.get("initializer") is not None:
            kwargs["initializer"](*kwargs.get("initargs", ()))

    def submit(self, fn, *args, **kwargs) -> Future:
        future: Future = Future()
        self.recorder.in_worker_task += 1
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001 (delivered through the future, like a pool's)
            future.set_exception(error)
        finally:
            self.recorder.in_worker_task -= 1
        return future

    def shutdown(self, wait: bool = True, **kwargs) -> None:
        pass


def _stand_ins(recorder: HostSyncRecorder) -> dict[str, object]:
    class Event:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def record(self, stream=None) -> None:
            pass

        def wait(self, stream=None) -> None:
            pass

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            recorder.note("device to host", "torch.cuda.Event.synchronize")

        def elapsed_time(self, other) -> float:
            return 0.0

    class Stream:
        def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
            self.device = torch.device("cuda", 0) if device is None else torch.device(device)

        def wait_event(self, event) -> None:
            pass

        def wait_stream(self, stream) -> None:
            pass

        def record_event(self, event=None):
            return event if event is not None else Event()

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            recorder.note("device to host", "torch.cuda.Stream.synchronize")

    def pin_memory(tensor, *args, **kwargs):
        setattr(tensor, PINNED, True)
        return tensor

    return {
        "torch.cuda.Event": Event,
        "torch.cuda.Stream": Stream,
        "torch.cuda.current_stream": lambda device=None: Stream(device),
        "torch.cuda.default_stream": lambda device=None: Stream(device),
        "torch.cuda.stream": lambda stream=None: contextlib.nullcontext(),
        "torch.cuda.device": lambda device=None: contextlib.nullcontext(),
        "torch.cuda.set_device": lambda device: None,
        "torch.cuda.synchronize": lambda device=None: recorder.note("device to host", "torch.cuda.synchronize"),
        "torch.cuda.get_device_capability": lambda device=None: DEVICE_CAPABILITY,
        "torch.cuda.is_available": lambda: True,
        "torch.Tensor.pin_memory": pin_memory,
        "torch.Tensor.is_pinned": lambda tensor, *args: getattr(tensor, PINNED, False),
        "torch.Tensor.record_stream": lambda tensor, stream: None,
        "trainer.parallel.device_threads.ThreadPoolExecutor": type("Inline", (_Inline,), {"recorder": recorder}),
    }


@contextlib.contextmanager
def fake_cuda_runtime(recorder: HostSyncRecorder):
    """Stand-ins for the driver's calls while the block runs (see the module docstring)."""
    _in_place_ops_without_meta_kernels()
    with contextlib.ExitStack() as stack:
        for target, stand_in in _stand_ins(recorder).items():
            stack.enter_context(mock.patch(target, stand_in))
        yield
