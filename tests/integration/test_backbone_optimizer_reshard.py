"""The backbone optimizer's state survives a change of world size under every ZeRO stage: 2 steps on
2 ranks, 2 on 1 rank, 2 back on 2 ranks (each resumed from the previous checkpoint) end where 6
steps never resharded end, weights and momentum.  A small MLP without BatchNorm on a fixed global
batch split over the ranks, so the two paths differ only by float rounding; with the momentum
restarting at each reshard they would differ by far more (checked below)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.checkpoint import save_checkpoint
from trainer.checkpoint.checkpoint_files import complete_checkpoints
from trainer.checkpoint.engine_state import OPTIMIZER_FILE, EngineState, load_engine
from trainer.checkpoint.optimizer_state import full_optimizer_state
from trainer.engine.deepspeed_setup import initialize_backbone, load_deepspeed_config
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH, WIDTH = 8, 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 3))


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, WIDTH, generator=generator), torch.randn(GLOBAL_BATCH, 3, generator=generator)


def _run(stage: int, steps: list[int], resume: str | None, save_to: str | None, result: str | None,
         forget_momentum: bool, save_early: tuple[int, str] | None) -> None:
    """Train ``steps`` (each rank its slice of the global batch), resuming and saving as asked;
    ``save_early``: (steps done, folder), a checkpoint on the way too."""
    dims = init_distributed()
    local = GLOBAL_BATCH // dims.world_size
    config = load_deepspeed_config(REPO / "ds_configs" / f"zero{stage}.json", micro_batch=local)
    engine, _ = initialize_backbone(_model(), config, lr=0.1, momentum=0.9, weight_decay=1e-3)
    if resume is not None:
        if forget_momentum:  # what resharding did before optimizer.pt: the state restarts
            (Path(resume) / OPTIMIZER_FILE).unlink(missing_ok=True)
            torch.distributed.barrier()
        load_engine(Path(resume), engine, dims, log=lambda message: None)
    for step in steps:
        inputs, targets = _global_batch(step)
        mine = slice(dims.rank * local, (dims.rank + 1) * local)
        loss = nn.functional.mse_loss(engine(inputs[mine]), targets[mine])
        engine.backward(loss)
        engine.step()
        if save_early is not None and step + 1 == save_early[0]:
            save_checkpoint(Path(save_early[1]), step + 1, {"engine": EngineState(engine)}, dims, keep=1)
    if save_to is not None:
        save_checkpoint(Path(save_to), steps[-1] + 1, {"engine": EngineState(engine)}, dims, keep=1)
    momentum = full_optimizer_state(engine, keep=dims.rank == 0)
    if result is not None and dims.rank == 0:
        torch.save(momentum, result)


def _train(stage: int, ranks: int, steps: list[int], resume: Path | None = None, save_to: Path | None = None,
           result: Path | None = None, forget_momentum: bool = False,
           save_early: tuple[int, Path] | None = None) -> None:
    spawn_local_workers(_run, ranks, stage, steps, None if resume is None else str(resume),
                        None if save_to is None else str(save_to), None if result is None else str(result),
                        forget_momentum, None if save_early is None else (save_early[0], str(save_early[1])))


def _latest(directory: Path) -> Path:
    return complete_checkpoints(directory)[-1]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint / "model.pt", weights_only=True)


def _resharded_2_1_2(stage: int, tmp_path: Path, forget_momentum: bool = False, first: Path | None = None) -> Path:
    """``first``: the checkpoint after 2 steps on 2 ranks, when the reference run saved it on its way."""
    second, third = tmp_path / "on_one", tmp_path / "back_on_two"
    if first is None:
        first = tmp_path / "on_two"
        _train(stage, 2, [0, 1], save_to=first)
    _train(stage, 1, [2, 3], resume=_latest(first), save_to=second,
           forget_momentum=forget_momentum)
    _train(stage, 2, [4, 5], resume=_latest(second), save_to=third,
           result=tmp_path / "state.pt", forget_momentum=forget_momentum)
    return _latest(third)


# ZeRO-2 (partitioned optimizer state) in `make test`; the other stages in the slow run.
@pytest.mark.parametrize("stage", [2, *(pytest.param(stage, marks=pytest.mark.slow) for stage in (0, 1, 3))])
def test_steps_after_2_1_2_resharding_equal_the_same_steps_unresharded(stage, tmp_path):
    reference_dir, after_two = tmp_path / "reference", tmp_path / "reference_after_2"
    _train(stage, 2, list(range(6)), save_to=reference_dir, result=tmp_path / "reference_state.pt",
           save_early=(2, after_two))  # the resharded path starts from the reference's own step 2
    reference = _latest(reference_dir)
    resharded = _resharded_2_1_2(stage, tmp_path / "resharded", first=after_two)
    assert resharded.name == reference.name

    state = torch.load(tmp_path / "resharded" / "state.pt", weights_only=True)
    reference_state = torch.load(tmp_path / "reference_state.pt", weights_only=True)
    assert set(state) == set(reference_state) == {name for name in _weights(reference)}
    for name, saved in reference_state.items():
        assert saved["momentum_buffer"].abs().max() > 1e-3, "no momentum to carry"
        torch.testing.assert_close(state[name]["momentum_buffer"], saved["momentum_buffer"], atol=1e-6, rtol=1e-5)
    for name, weight in _weights(reference).items():
        torch.testing.assert_close(_weights(resharded)[name], weight, atol=1e-6, rtol=1e-5)
    # The saved file holds the state the next run starts from, whole.
    assert torch.load(resharded / OPTIMIZER_FILE, weights_only=True).keys() == reference_state.keys()


@pytest.mark.slow  # the negative control of the exact reshard test above
def test_without_the_optimizer_state_the_momentum_restarts_and_the_weights_differ(tmp_path):
    """The comparison above can fail: restarting the momentum at each reshard moves the weights."""
    reference_dir = tmp_path / "reference"
    _train(0, 2, list(range(6)), save_to=reference_dir)
    restarted = _resharded_2_1_2(0, tmp_path / "restarted", forget_momentum=True)
    reference = _weights(_latest(reference_dir))
    gaps = [(_weights(restarted)[name] - weight).abs().max().item() for name, weight in reference.items()]
    assert max(gaps) > 1e-3
