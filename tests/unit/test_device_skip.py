"""``optim.on_nonfinite: skip_step`` decided on the device (``trainer.engine.device_skip``): a step
whose loss or gradient is NaN or inf changes nothing (weights, momentum, the rows and their momentum,
BatchNorm statistics, bit for bit), a finite one is the plain step, and neither reads anything on the
host; the counters are read on log steps only."""

import copy

import pytest
import torch
from torch import nn

from tests.helpers.data_dependent_ops import DataDependentOps
from trainer.engine.device_skip import DeviceStepSkipper
from trainer.engine.stop_conditions import NonFiniteLossError
from trainer.optim import OptimizerSettings, build_optimizer, create_initial_state


class _Rows:
    """An objective whose only per-step state is rows stepped by torch's fused SGD (as ``instance``)."""

    skips_on_device = True

    def __init__(self) -> None:
        self.weight = nn.Parameter(torch.randn(6, 3))
        self.optimizer = torch.optim.SGD([self.weight], lr=0.5, momentum=0.9, weight_decay=1e-4, fused=True)

    def optimizers(self):
        return [self.optimizer]


class _Log:
    def __init__(self) -> None:
        self.records = []

    def write(self, **record) -> None:
        self.records.append(record)


class _Metrics:
    class _Counter:
        def __init__(self) -> None:
            self.value = 0

        def inc(self, amount=1) -> None:
            self.value += amount

    def __init__(self) -> None:
        self.nonfinite_skipped = self._Counter()


def _setup(max_in_a_row=3):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    optimizer = build_optimizer(OptimizerSettings(name="sgd", momentum=0.9, weight_decay=1e-4), module, 0.1)
    create_initial_state(optimizer)  # as initialize_backbone does
    objective, log, metrics = _Rows(), _Log(), _Metrics()
    skipper = DeviceStepSkipper(module, optimizer, objective, None, torch.device("cpu"), max_in_a_row, metrics,
                                log, lambda message: None)
    return module, optimizer, objective, skipper, log, metrics


def _step(module, optimizer, objective, skipper, poison: str | None):
    """One trainer step on the device path; ``poison``: "loss" (NaN loss) or "gradient" (a finite loss
    with an infinite gradient behind it)."""
    buffers = [buffer.clone() for buffer in module.buffers()]  # the trainer's StepSkipper.before_forward
    features = module(torch.randn(5, 3))
    if poison == "gradient":
        features = features + 0 * features.detach()  # finite forward
        features.register_hook(lambda grad: grad * float("inf"))
    loss = (features @ objective.weight.T).pow(2).mean()
    if poison == "loss":
        loss = loss * float("nan")
    loss.backward()
    with DataDependentOps() as reads:
        apply = skipper.decide(loss)
        optimizer.step()
        objective.optimizer.step()
        skipper.after_step(apply, buffers)
    optimizer.zero_grad()
    objective.optimizer.zero_grad()
    assert reads.ops == []
    return apply


def _state(module, optimizer, objective):
    tensors = [*module.state_dict().values(), objective.weight.detach()]
    tensors += [s["momentum_buffer"] for s in optimizer.state.values()]
    tensors += [s["momentum_buffer"] for s in objective.optimizer.state.values()]
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("poison", ["loss", "gradient"])
@pytest.mark.parametrize("first", [True, False], ids=["at the first step", "after a kept step"])
def test_a_nonfinite_step_changes_nothing_and_reads_nothing_on_the_host(poison, first):
    module, optimizer, objective, skipper, log, metrics = _setup()
    if not first:
        assert bool(_step(module, optimizer, objective, skipper, None))
    before = _state(module, optimizer, objective)
    assert not bool(_step(module, optimizer, objective, skipper, poison))
    after = _state(module, optimizer, objective)
    assert len(before) == len(after) == 17  # 9 of the state dict, the rows, 6 + 1 momentum buffers
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # the next finite step is a plain step again (no condition left behind)
    assert optimizer.step_condition is None and objective.optimizer.found_inf is None
    assert bool(_step(module, optimizer, objective, skipper, None))
    assert not all(torch.equal(a, b) for a, b in zip(after, _state(module, optimizer, objective)))


def test_a_kept_step_is_the_plain_step():
    module, optimizer, objective, skipper, _, _ = _setup()
    plain_module, plain_objective = copy.deepcopy(module), copy.deepcopy(objective)
    plain_optimizer = build_optimizer(OptimizerSettings(name="sgd", momentum=0.9, weight_decay=1e-4), plain_module,
                                      0.1)
    for step in range(2):
        torch.manual_seed(step)
        _step(module, optimizer, objective, skipper, None)
        torch.manual_seed(step)
        features = plain_module(torch.randn(5, 3))
        (features @ plain_objective.weight.T).pow(2).mean().backward()
        plain_optimizer.step()
        plain_objective.optimizer.step()
        plain_optimizer.zero_grad()
        plain_objective.optimizer.zero_grad()
    plain_state = _state(plain_module, plain_optimizer, plain_objective)
    for mine, plain in zip(_state(module, optimizer, objective), plain_state):
        torch.testing.assert_close(mine, plain, rtol=1e-6, atol=1e-7)


def test_log_steps_report_the_skipped_steps_and_stop_after_too_many_in_a_row():
    module, optimizer, objective, skipper, log, metrics = _setup(max_in_a_row=2)
    skipper.start_at(10)
    _step(module, optimizer, objective, skipper, None)  # step 11
    _step(module, optimizer, objective, skipper, "loss")  # step 12
    skipper.check(12, None)
    assert log.records == [dict(event="nonfinite_step_skipped", step=12, skipped=1, in_a_row=1)]
    assert metrics.nonfinite_skipped.value == 1
    skipper.check(12, None)  # nothing new
    assert len(log.records) == 1
    _step(module, optimizer, objective, skipper, "gradient")  # step 13: the second in a row
    with pytest.raises(NonFiniteLossError, match="2 steps in a row up to step 13 had a NaN or inf loss or gradient"):
        skipper.check(13, None)
