"""Every key of an optimizer's state goes through the checkpoint's consolidated form, whatever the
optimizer: AdamW's step counter with its moments, and a toy optimizer's own keys, with no change
to the checkpoint code.  One process, below ZeRO (the state is per parameter); the ZeRO and
world-size changes are tests/integration/test_optimizer_state_reshard.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from trainer.checkpoint.optimizer_state import full_optimizer_state, load_full_optimizer_state, state_keys
from trainer.optim import OptimizerSettings, build_optimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 2))


def _step(model: nn.Module, optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(8, 5, generator=generator)
    optimizer.zero_grad()
    model(inputs).square().mean().backward()
    optimizer.step()


def _adamw(model: nn.Module):
    return build_optimizer(OptimizerSettings(name="adamw", weight_decay=0.05), model, lr=0.01)


def test_adamw_resumes_with_its_step_counter_and_then_steps_as_if_never_stopped():
    """Without ``step`` the resumed AdamW would restart its bias correction at step 1."""
    model = _model()
    optimizer = _adamw(model)
    for step in range(3):
        _step(model, optimizer, step)
    saved = full_optimizer_state(SimpleNamespace(module=model, optimizer=optimizer))
    assert {name: float(state["step"]) for name, state in saved.items()} == {n: 3.0 for n, _ in
                                                                             model.named_parameters()}
    assert set(saved["0.weight"]) == {"exp_avg", "exp_avg_sq", "step"}

    resumed = _model()
    resumed.load_state_dict(model.state_dict())
    resumed_optimizer = _adamw(resumed)
    assert load_full_optimizer_state(SimpleNamespace(module=resumed, optimizer=resumed_optimizer), saved) == []
    for step in range(3, 5):
        _step(model, optimizer, step)
        _step(resumed, resumed_optimizer, step)
    for name, weight in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], weight), name


class Ema(torch.optim.Optimizer):
    """A toy optimizer with a per-element trace and a scalar count of its own: the kind of state a
    new optimizer brings."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    def initial_state(self, tensor: torch.Tensor, group: dict) -> dict:
        return {"trace": torch.zeros_like(tensor), "count": 0}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(self.initial_state(p, group))
                state["trace"].mul_(0.5).add_(p.grad)
                state["count"] += 1
                p.sub_(group["lr"] * state["trace"] / state["count"])


def test_a_new_optimizers_own_keys_are_carried_without_changes_to_the_checkpoint_code():
    model = _model()
    optimizer = Ema(model.parameters(), lr=0.1)
    for step in range(2):
        _step(model, optimizer, step)
    assert state_keys(optimizer) == (["trace"], ["count"])
    saved = full_optimizer_state(SimpleNamespace(module=model, optimizer=optimizer))
    resumed = _model()
    resumed_optimizer = Ema(resumed.parameters(), lr=0.1)
    load_full_optimizer_state(SimpleNamespace(module=resumed, optimizer=resumed_optimizer), saved)
    for original, loaded in zip(model.parameters(), resumed.parameters()):
        state, state_loaded = optimizer.state[original], resumed_optimizer.state[loaded]
        assert state_loaded["count"] == 2 and isinstance(state_loaded["count"], int)
        assert torch.equal(state_loaded["trace"], state["trace"])
