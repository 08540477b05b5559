"""What `instcls bench step` counts per phase: the ops a dispatch mode sees (a foreach op once), given
to the phase whose mark ends them, on the counted step only; and on CUDA the kernels, each given
to the phase its launch started in."""

from types import SimpleNamespace

import torch

from trainer.bench.cuda_kernels import UNATTRIBUTED, kernels_per_phase
from trainer.bench.op_counting import OpCounter
from trainer.bench.step_instruments import InstrumentedPhases, StepInstruments
from trainer.observability.step_phases import StepPhases


def test_the_counter_counts_each_dispatched_op_once_by_name():
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    with OpCounter() as ops:
        c = torch.mm(a, b)
        d = c + 1.0
        d.sum()
        a.t()
    assert ops.by_op == {"aten.mm.default": 1, "aten.add.Tensor": 1, "aten.sum.default": 1, "aten.t.default": 1}
    assert ops.total == 4


def test_a_foreach_op_counts_once_where_the_loop_over_tensors_counts_each():
    params = [torch.randn(5) for _ in range(6)]
    grads = [torch.randn(5) for _ in range(6)]
    with OpCounter() as foreach:
        torch._foreach_add_(params, grads, alpha=-0.1)
    with OpCounter() as loop:
        for param, grad in zip(params, grads):
            param.add_(grad, alpha=-0.1)
    assert foreach.by_op == {"aten._foreach_add_.List": 1}
    assert loop.by_op == {"aten.add_.Tensor": 6}


def test_the_backward_is_counted_when_the_counter_is_active_around_it_and_annotations_are_not():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 2, requires_grad=True)
    loss = (a @ b).sum()
    with OpCounter() as ops:
        loss.backward()
    assert ops.by_op["aten.mm.default"] == 2  # dL/da = g b^T and dL/db = a^T g
    optimizer = torch.optim.SGD([a, b], lr=0.1, foreach=True)  # its step opens a profiler annotation
    with OpCounter() as ops:
        optimizer.step()
    assert ops.by_op == {"aten._foreach_add_.List": 1}


def test_take_hands_over_what_was_counted_since_the_last_take():
    x = torch.randn(3)
    with OpCounter() as ops:
        x.neg()
        first = ops.take()
        x.exp()
        x.exp()
        second = ops.take()
    assert first == {"aten.neg.default": 1} and second == {"aten.exp.default": 2} and ops.total == 3


def _step(phases, instruments, x: torch.Tensor) -> None:
    """A step shaped like the trainer's: forward, the loop's own work, a checkpoint after a resume."""
    instruments.step_starts()
    phases.begin()
    x.neg()
    phases.end("forward")
    x.exp()
    x.exp()
    phases.end("backward")
    x.abs()  # the loop's own work between the phases: no phase's
    phases.resume()
    x.sin()
    phases.end("checkpoint")
    phases.finish()
    instruments.step_ends()


def test_the_instruments_give_each_phase_the_ops_before_its_end_on_the_counted_step_only():
    instruments = StepInstruments(count_step=1, sync_sites=[])
    phases = InstrumentedPhases(StepPhases(torch.device("cpu")), instruments)
    x = torch.randn(3)
    for _ in range(3):
        _step(phases, instruments, x)
    assert instruments.ops == {"forward": 1, "backward": 2, "checkpoint": 1}
    assert instruments.ops_by_name["backward"] == {"aten.exp.default": 2}
    assert len(phases.completed()) == 3  # the StepPhases underneath still times every step


def test_the_instruments_give_each_phase_the_host_syncs_recorded_before_its_end():
    sites: list[str] = []
    instruments = StepInstruments(count_step=5, sync_sites=sites)
    phases = InstrumentedPhases(StepPhases(torch.device("cpu")), instruments)
    for syncs_in_forward in (1, 3):
        instruments.step_starts()
        phases.begin()
        sites.extend(["forward site"] * syncs_in_forward)
        phases.end("forward")
        sites.append("between phases")
        phases.resume()
        sites.append("optimizer site")
        phases.end("optimizer")
        phases.finish()
        instruments.step_ends()
    assert instruments.host_syncs == [{"forward": 1, "optimizer": 1}, {"forward": 3, "optimizer": 1}]
    assert instruments.summary(slice(0, 2))["host_syncs"] == {"forward": 2.0, "optimizer": 1.0}


def _event(name: str, start: float, end: float, activity: str = "cpu_op", correlation: int = 0):
    return SimpleNamespace(name=name, id=correlation, activity_type=activity,
                           time_range=SimpleNamespace(start=start, end=end))


def test_each_cuda_kernel_goes_to_the_phase_its_launch_started_in():
    labels = {"seg.0": "forward", "seg.1": "", "seg.2": "backward"}
    events = [
        _event("seg.0", 0, 10), _event("seg.1", 10, 12), _event("seg.2", 12, 30),
        _event("cudaLaunchKernel", 2, 3, "cuda_runtime", correlation=7),
        _event("cuLaunchKernel", 5, 6, "cuda_driver", correlation=8),  # Triton's launch
        _event("cudaLaunchKernel", 11, 11.5, "cuda_runtime", correlation=9),  # between phases: dropped
        _event("cudaLaunchKernelExC", 20, 21, "cuda_runtime", correlation=10),
        # the GPU runs kernels late: their own times say nothing of the phase that asked for them
        _event("gemm", 40, 50, "kernel", correlation=7), _event("triton_", 50, 51, "kernel", correlation=8),
        _event("elementwise", 51, 52, "kernel", correlation=9), _event("nccl", 52, 60, "kernel", correlation=10),
        _event("Memcpy HtoD", 60, 61, "gpu_memcpy", correlation=11),  # not a kernel
        _event("orphan", 61, 62, "kernel", correlation=99),  # its launch was not recorded
    ]
    assert kernels_per_phase(events, labels) == {"forward": 2, "backward": 1, UNATTRIBUTED: 1}
