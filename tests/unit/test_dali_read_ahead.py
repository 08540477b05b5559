"""DALI's source reads ahead on a background thread, so the training thread (which
DALI calls the source on, inside ``next()``) only picks up finished reads."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from data_pipeline.loading.dali_loader import READ_AHEAD, _StepSource


class _Reader:
    """Records which thread read which step; step ``bad`` raises like an unreadable sample."""

    def __init__(self, bad: int | None = None) -> None:
        self.reads: list[tuple[int, int, str]] = []
        self.bad = bad
        self.release = threading.Event()

    def read(self, epoch: int, step: int):
        self.release.wait(5)
        self.reads.append((epoch, step, threading.current_thread().name))
        if step == self.bad:
            raise ValueError(f"step {step}: shard-00000.tar member 7 is not an image")
        view = SimpleNamespace(crop=np.zeros((1, 4), dtype=np.int64), colour=np.zeros((1, 3, 4), np.float32),
                               blur=np.zeros(1, bool), sigma=np.zeros(1, np.float32), window=np.zeros(1, np.int32),
                               flip=np.zeros(1, bool))
        return SimpleNamespace(samples=("samples of", epoch, step), jpegs=[np.zeros(1, np.uint8)], views=[view])


def test_the_next_steps_are_read_on_a_background_thread_before_dali_asks():
    reader = _Reader()
    source = _StepSource(reader)
    source.start(epoch=4, steps=range(10, 20))
    reader.release.set()
    source(0)
    source._reads[READ_AHEAD].result()  # submitted ahead of DALI's request for it
    assert [(e, s) for e, s, _ in reader.reads] == [(4, 10 + i) for i in range(READ_AHEAD + 1)]
    assert all(thread.startswith("dali-read-ahead") for _, _, thread in reader.reads)
    assert source.pending[0] == ("samples of", 4, 10)


def test_a_bad_samples_error_reaches_dali_at_its_step_and_a_new_pass_drops_old_reads():
    reader = _Reader(bad=11)
    source = _StepSource(reader)
    source.start(epoch=0, steps=range(10, 14))
    reader.release.set()
    source(0)
    with pytest.raises(ValueError, match="step 11: shard-00000.tar member 7"):
        source(1)
    source.start(epoch=1, steps=range(0, 2))
    source(0)
    with pytest.raises(StopIteration):
        source(2)
    assert ("samples of", 1, 0) in source.pending
