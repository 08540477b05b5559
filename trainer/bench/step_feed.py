"""What the trainer of `instcls bench step` pulls its batches from.

``StepFeed`` takes the place of ``Trainer.train_loader`` (the loop calls only its
``epoch_batches``) and tells the bench's instruments when each step starts and ends: a step starts
when its batch is handed over and ends when the loop asks for the next one.  Its batches come from
the job's own loader (``--data loader``) or are one synthetic batch made once on the device and
handed over every step (``--data synthetic``), so that no loader work hides the step's own cost.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator

import torch

from trainer.bench.step_instruments import StepInstruments


def random_views(sides: tuple[int, ...], batch: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """One normalised-looking float32 NCHW tensor per view (``ViewLayout.sides``), on ``device``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(batch, 3, side, side, device=device, generator=generator) for side in sides]


def synthetic_batch(loader, views: list[torch.Tensor]):
    """The first batch of ``loader`` (its ids, masks and the sampler's plan) with ``views`` in place
    of its images: every field the trainer and the objective read, on the device, owned by us (DALI
    reuses its buffers)."""
    batches = loader.epoch_batches(0)
    try:
        template = next(batches)
    finally:
        batches.close()
    shapes = [tuple(view.shape) for view in template.views]
    if shapes != [tuple(view.shape) for view in views]:
        raise ValueError(f"the loader's views are {shapes}, the synthetic ones "
                         f"{[tuple(v.shape) for v in views]}: the bench must build them from the job's view layout")
    return replace(template, views=views, instance_ids=template.instance_ids.clone(), valid=template.valid.clone())


class StepFeed:
    """``epoch_batches(epoch, start_step)`` as a loader has it, each batch announced to ``instruments``."""

    def __init__(self, batches: Callable[[int, int], Iterator], steps_per_epoch: int,
                 instruments: StepInstruments) -> None:
        self._batches, self.steps_per_epoch, self._instruments = batches, steps_per_epoch, instruments

    @classmethod
    def repeating(cls, batch, steps_per_epoch: int, instruments: StepInstruments) -> StepFeed:
        """The same ``batch`` at every step."""
        return cls(lambda epoch, start: (batch for _ in range(start, steps_per_epoch)), steps_per_epoch, instruments)

    def epoch_batches(self, epoch: int, start_step: int = 0) -> Iterator:
        for batch in self._batches(epoch, start_step):
            self._instruments.step_starts()
            yield batch
            self._instruments.step_ends()
