"""The step's phases: host clock on CPU ranks, CUDA events on GPUs read only once the device has
passed them (never a wait), repeated phases summed, the loop's own work between phases left out."""

import time

import torch

from trainer.observability.step_phases import StepPhases


def test_cpu_phases_are_the_host_time_between_marks():
    phases = StepPhases(torch.device("cpu"))
    phases.begin()
    time.sleep(0.02)
    phases.end("forward")
    time.sleep(0.01)
    phases.end("objective")
    time.sleep(0.03)
    phases.resume()  # the loop's logging: nobody's phase
    time.sleep(0.01)
    phases.end("checkpoint")
    phases.finish()
    (step,) = phases.completed()
    assert set(step) == {"forward", "objective", "checkpoint"}
    assert 0.02 <= step["forward"] < 0.2 and 0.01 <= step["objective"] < 0.2 and 0.01 <= step["checkpoint"] < 0.03
    assert phases.completed() == []  # read once


class FakeEvent:
    """A CUDA event whose completion the test decides; elapsed_time in milliseconds, as torch's."""

    now = 0.0
    everything_done = False

    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing

    def record(self) -> None:
        FakeEvent.now += 5.0
        self.at = FakeEvent.now

    def query(self) -> bool:
        return FakeEvent.everything_done

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.at - self.at


def test_cuda_phases_wait_for_the_device_without_syncing_and_sum_repeated_phases(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    phases = StepPhases(torch.device("cpu"))
    phases.on_cuda = True
    phases.begin()
    phases.end("forward")
    phases.end("forward")  # a second group of views
    phases.end("backward")
    phases.finish()
    assert phases.completed() == []  # the device has not got there yet: nothing read, nothing waited for
    FakeEvent.everything_done = True
    assert phases.completed() == [{"forward": 0.010, "backward": 0.005}]
