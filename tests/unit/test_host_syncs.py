"""The host-sync recorder on fake CUDA tensors (no GPU: a CUDA build of torch makes fake ``cuda``
tensors under FakeTensorMode): planted syncs are each found with their line, and the step's own
code (the smoothing weights, Sinkhorn) makes no host sync per step."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from trainer.dry_run.host_syncs import HostSyncRecorder

CUDA = torch.device("cuda")


def _recorded(fn):
    with FakeTensorMode(), HostSyncRecorder() as recorder:
        fn()
    return recorder.syncs


def test_planted_host_syncs_are_each_found_with_their_line():
    def plant():
        weights = torch.full((1, 3), 0.1, device=CUDA)
        weights[0, 0] = 0.8  # an element assignment from the host
        torch.tensor(-math.inf, device=CUDA)  # a tensor made from host data
        torch.ones(3).to(CUDA)  # a host tensor moved over
        torch.randn(4, device=CUDA).cpu()  # a device tensor read back

    syncs = _recorded(plant)
    assert [s.kind for s in syncs] == ["host to device"] * 3 + ["device to host"]
    lines = [int(s.where.split(":")[1].split()[0]) for s in syncs]
    first = plant.__code__.co_firstlineno
    assert [line - first for line in lines] == [2, 3, 4, 5]
    assert all(s.where.startswith("tests/unit/test_host_syncs.py:") for s in syncs)


@pytest.mark.parametrize("read, kind, op", [
    (lambda x: x.sum().item(), "device to host", "aten._local_scalar_dense.default"),
    (lambda x: x[x > 0], "data-dependent size", "aten.index.Tensor"),
    (lambda x: x.nonzero(), "data-dependent size", "aten.nonzero.default"),
])
def test_a_value_the_host_must_wait_for_is_recorded_before_fake_tensors_refuse_it(read, kind, op):
    """Fake tensors have no values: reading one (or an output sized by them) raises after the record."""
    with FakeTensorMode(), HostSyncRecorder() as recorder:
        with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
            read(torch.randn(4, device=CUDA))
        syncs = list(recorder.syncs)
    assert [(s.kind, s.op) for s in syncs] == [(kind, op)]


def test_device_only_work_records_nothing():
    def device_only():
        x = torch.randn(8, 4, device=CUDA)
        torch.where(x > 0, x, -math.inf).logsumexp(dim=1)
        torch.full((1, 2), 0.5, device=CUDA) * x[:1, :2]

    assert _recorded(device_only) == []


def test_the_smoothing_weights_and_sinkhorn_make_no_host_sync_per_step():
    """The top-K target weights are built on the device (not written element by element from the
    host) and Sinkhorn makes its -inf tensor without host data, so neither syncs in any step."""
    from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
    from trainer.objectives.swav.sinkhorn import distributed_sinkhorn
    from trainer.parallel import single_process_dims

    classifier = ShardedCosineClassifier(ClassifierConfig(num_classes=20, feature_dim=4, top_k=5, smoothing_alpha=0.2),
                                         single_process_dims(torch.device("cpu")))

    def step_parts():
        weights = classifier._target_weights(5, CUDA)
        assert weights.device.type == "cuda" and tuple(weights.shape) == (1, 6)
        scores = torch.randn(6, 10, device=CUDA)
        valid = torch.ones(6, dtype=torch.bool, device=CUDA)
        distributed_sinkhorn(scores, 0.05, 3, None, valid=valid, total_valid=6)

    assert _recorded(step_parts) == []
