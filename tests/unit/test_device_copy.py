"""Host -> device copies on the step path: pinned and asynchronous on CUDA, untouched on CPU.

No GPU here: a fake makes ``torch.device("cuda")`` copies record what they were asked to do."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from data_pipeline.loading.base_loader import IndexedLoader
from data_pipeline.loading.device_copy import to_device
from data_pipeline.loading.sample_reader import StepSamples
from data_pipeline.loading.samplers.base import StepIndices

CUDA = torch.device("cuda")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Every ``Tensor.to``/``pin_memory`` call, recorded; copies to "cuda" stay on the CPU."""
    calls = []
    real_to = torch.Tensor.to

    def pin_memory(self):
        calls.append(("pin", self.data_ptr()))
        pinned = self.clone()
        pinned.fake_pinned = True
        return pinned

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, torch.device) and target.type == "cuda":
            calls.append(("to", getattr(self, "fake_pinned", False), kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: getattr(self, "fake_pinned", False))
    monkeypatch.setattr(torch.Tensor, "to", to)
    return calls


def test_a_host_array_is_pinned_then_copied_without_blocking(fake_cuda):
    out = to_device(np.arange(4), CUDA)
    assert [call[0] for call in fake_cuda] == ["pin", "to"]
    assert fake_cuda[-1] == ("to", True, True)  # from pinned memory, non_blocking
    assert out.tolist() == [0, 1, 2, 3]


def test_an_already_pinned_tensor_is_not_pinned_again(fake_cuda):
    pinned = torch.arange(3).pin_memory()
    fake_cuda.clear()
    to_device(pinned, CUDA)
    assert fake_cuda == [("to", True, True)]


def test_on_cpu_nothing_is_pinned_or_copied(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pytest.fail("pinned on a CPU run"))
    array = np.arange(5)
    out = to_device(array, torch.device("cpu"))
    assert out.data_ptr() == array.ctypes.data  # the numpy memory itself, as before
    tensor = torch.ones(2)
    assert to_device(tensor, torch.device("cpu")) is tensor


def test_the_loader_pins_a_steps_ids_masks_and_labels_on_cuda(fake_cuda):
    loader = IndexedLoader.__new__(IndexedLoader)  # only _batch's inputs: no shards needed
    loader.device, loader.view_kinds = CUDA, ["global"]
    ids, valid = np.array([3, 1]), np.array([True, False])
    plan = StepIndices(ids=ids[None], valid=valid[None])
    samples = StepSamples(step=0, ids=ids, valid=valid, global_valid=1, labels=np.array([0, -1]), plan=plan,
                          next_plan=None)
    batch = loader._batch([torch.zeros(2, 3, 4, 4)], samples)
    copies = [call for call in fake_cuda if call[0] == "to"]
    assert len(copies) == 4 and all(call == ("to", True, True) for call in copies), fake_cuda
    assert batch.instance_ids.tolist() == [3, 1] and batch.labels.tolist() == [0, -1]


STEP_PATH = [
    "data_pipeline/loading/base_loader.py",
    "trainer/objectives/pic/objective.py",
    "trainer/objectives/pic/working_set.py",
    "trainer/objectives/pic/lazy_sgd.py",
    "trainer/objectives/pic/row_store.py",
]


@pytest.mark.parametrize("path", STEP_PATH)
def test_step_path_host_arrays_reach_the_device_through_to_device(path):
    # A pageable ``torch.from_numpy(x).to(device)`` blocks the CPU on CUDA, non_blocking or not.
    source = (Path(__file__).resolve().parents[2] / path).read_text()
    assert not re.findall(r"from_numpy\([^\n]*\)\.to\(", source), path
