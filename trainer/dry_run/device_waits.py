"""Counting the times the host waits for the whole device, by thread and by source line.

CUDA's sync-debug mode does not warn on ``torch.cuda.synchronize()`` or ``Event.synchronize()``, and
DeepSpeed synchronises through its accelerator object (``get_accelerator().synchronize()``: its
throughput timer does, twice a step, from step 3 on).  ``DeviceWaitCounter`` wraps each of these calls
for the length of a block and records who called it, so a test or a benchmark can count the waits
of DeepSpeed's real engine on any machine: on CPU ranks the accelerator's ``synchronize`` does
nothing, but it is still called, and counted.  Each record keeps its thread: a worker thread that
waits on its own stream (the PIC prefetch's side stream) does not stall the training thread.  A wait
is counted once, where it was asked for: on CUDA the accelerator's ``synchronize`` calls
``torch.cuda.synchronize``, which is wrapped too, and a wrapped call made inside another is not counted.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from trainer.dry_run.host_syncs import caller


@dataclass(frozen=True)
class DeviceWait:
    call: str  # which synchronising call
    where: str  # "path:line in function" of the code that made it
    thread: int  # threading.get_ident() of the caller


@dataclass
class DeviceWaitCounter:
    """``with DeviceWaitCounter() as waits: ...``; ``waits.on_thread(ident)`` or ``waits.records``.
    With ``sink``, each wait of ``thread`` (every thread's when None) is also appended to it as
    ``"CALL at WHERE"`` (the GPU step bench's list of sync sites)."""

    records: list[DeviceWait] = field(default_factory=list)
    sink: list[str] | None = None
    thread: int | None = None

    def __post_init__(self) -> None:
        self._stack = ExitStack()
        self._inside = threading.local()  # .depth: wrapped calls under way on this thread

    def _wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            depth = getattr(self._inside, "depth", 0)
            if depth == 0:
                wait = DeviceWait(label, caller(), threading.get_ident())
                self.records.append(wait)
                if self.sink is not None and self.thread in (None, wait.thread):
                    self.sink.append(f"{wait.call} at {wait.where}")
            self._inside.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.depth = depth

        own = name in vars(owner)  # else inherited from the class: restored by removing the wrapper
        setattr(owner, name, counted)
        self._stack.callback(setattr, owner, name, original) if own else self._stack.callback(delattr, owner, name)

    def __enter__(self) -> DeviceWaitCounter:
        try:
            from trainer.parallel.deepspeed_import import deepspeed
        except ImportError:  # a machine without DeepSpeed: torch's own waits are still counted
            deepspeed = None
        if deepspeed is not None:
            accelerator = deepspeed.get_accelerator()
            self._wrap(accelerator, "synchronize", f"{type(accelerator).__name__}.synchronize")
        self._wrap(torch.cuda, "synchronize", "torch.cuda.synchronize")
        self._wrap(torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize")
        self._wrap(torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize")
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def on_thread(self, thread: int) -> list[DeviceWait]:
        return [record for record in self.records if record.thread == thread]

    def mark(self) -> int:
        """The number of records so far: ``records[mark:]`` are those made since."""
        return len(self.records)
