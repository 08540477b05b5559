"""The SIGTERM agreement: off the step's critical path, still the same stop step on every rank.

Two ranks are simulated in one process: a fake ``all_reduce`` completes a collective (MAX) once
every rank has issued it, in issue order, as gloo matches collectives across ranks."""

import signal

import pytest
import torch

from trainer.engine import stop_conditions as preemption
from trainer.engine.stop_conditions import StopSignal

WORLD = 2


class _Work:
    def __init__(self, collective: dict) -> None:
        self.collective = collective

    def wait(self) -> None:
        # Gloo would block here until every rank joined; in lockstep they all have.
        assert len(self.collective["tensors"]) == WORLD, "waited on a reduction a rank never started"


class FakeControlGroup:
    def __init__(self) -> None:
        self.collectives: list[dict] = []
        self.issued = [0] * WORLD  # per rank: collectives issued so far
        self.blocking = 0
        self.rank = 0  # the rank calling now (set by the test's lockstep loop)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        assert group is self and op == torch.distributed.ReduceOp.MAX
        index = self.issued[self.rank]
        self.issued[self.rank] += 1
        if index == len(self.collectives):
            self.collectives.append({"tensors": []})
        collective = self.collectives[index]
        collective["tensors"].append(tensor)
        if len(collective["tensors"]) == WORLD:
            reduced = torch.stack(collective["tensors"]).amax(dim=0)
            for each in collective["tensors"]:
                each.copy_(reduced)
        if not async_op:
            self.blocking += 1
            assert len(collective["tensors"]) == WORLD, "a blocking all-reduce would deadlock the lockstep fake"
            return None
        return _Work(collective)


@pytest.fixture
def ranks(monkeypatch):
    group = FakeControlGroup()
    monkeypatch.setattr(preemption.dist, "all_reduce", group.all_reduce)
    previous = signal.getsignal(signal.SIGTERM)
    signals = [StopSignal(group) for _ in range(WORLD)]
    yield group, signals
    for stop in reversed(signals):
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == previous


def _run(group, signals, steps: int, sigterm_on: dict[int, int]) -> list[int | None]:
    """Each rank's stop step (1-based), ranks in lockstep; ``sigterm_on``: rank -> step during which
    it gets SIGTERM."""
    stopped: list[int | None] = [None] * WORLD
    for step in range(1, steps + 1):
        for rank, stop in enumerate(signals):
            if stopped[rank] is not None:
                continue
            if sigterm_on.get(rank) == step:
                stop._handle(signal.SIGTERM, None)
            group.rank = rank
            if stop.stop_after_step():
                stopped[rank] = step
    return stopped


def test_no_blocking_collective_in_the_steady_state(ranks):
    group, signals = ranks
    assert _run(group, signals, steps=20, sigterm_on={}) == [None, None]
    assert group.blocking == 0 and len(group.collectives) == 20  # one background reduction a step
    for stop in signals:
        stop.settle()


def test_a_sigterm_on_one_rank_stops_every_rank_after_the_same_step(ranks):
    group, signals = ranks
    # SIGTERM during step 5 on rank 1 only: every rank stops after step 6, one step later.
    assert _run(group, signals, steps=20, sigterm_on={1: 5}) == [6, 6]
    assert group.blocking == 0
    assert group.issued == [5, 5]  # nothing left in flight after the stop: the save's collectives come next


def test_the_skip_step_agreement_still_blocks_and_decides_this_step(monkeypatch):
    calls = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append(async_op)
        tensor[0] = 1  # another rank got SIGTERM

    monkeypatch.setattr(preemption.dist, "all_reduce", all_reduce)
    stop = StopSignal(object())
    try:
        # The backward of this very step depends on it: no deferring under skip_step.
        assert stop.agree(torch.tensor(float("nan"))) == (True, True)
        assert calls == [False]
    finally:
        stop.restore()


def test_without_a_control_group_a_sigterm_stops_a_step_later():
    stop = StopSignal(None)
    try:
        assert not stop.stop_after_step()
        stop._handle(signal.SIGTERM, None)
        assert not stop.stop_after_step() and stop.stop_after_step()
    finally:
        stop.restore()
