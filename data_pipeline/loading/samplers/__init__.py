"""Samplers: which global ids every rank reads at each training step, one module per kind,
registered here by name (``data.loader.sampler.kind`` picks one).

A new sampler is one module in this folder: a class following ``base.Sampler`` (``step(epoch,
step)``, ``steps_per_epoch``, a ``state_dict`` that names its sequence) and one
``register_sampler`` call below, with its tests.  Loaders, checkpoints and objectives only ever
see the ``Sampler`` protocol.  Evaluation always reads the stored order (``inference_sampler``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from data_pipeline.loading.samplers.base import Sampler
from data_pipeline.loading.samplers.epoch_permutation import EpochPermutationSampler
from data_pipeline.loading.samplers.sliding_window import SlidingWindowSampler


@dataclass(frozen=True)
class SamplerRequest:
    """What a training sampler is built from: the shard set's size, the job's layout, the loader's
    settings (``seed``, ``last_batch``) and the ``SamplerConfig`` (``settings``: its ``kind``-specific fields)."""

    num_samples: int
    world_size: int
    batch_size: int
    seed: int
    last_batch: str
    settings: Any  # data_pipeline.loading.loader_config.SamplerConfig


SAMPLERS: dict[str, Callable[[SamplerRequest], Sampler]] = {}


def register_sampler(kind: str, build: Callable[[SamplerRequest], Sampler]) -> None:
    """Make ``data.loader.sampler.kind: <kind>`` build training samplers with ``build(request)``."""
    if kind in SAMPLERS and SAMPLERS[kind] is not build:
        raise ValueError(f"a sampler kind {kind!r} is already registered")
    SAMPLERS[kind] = build


def sampler_kinds() -> tuple[str, ...]:
    return tuple(SAMPLERS)


def training_sampler(request: SamplerRequest) -> Sampler:
    kind = request.settings.kind
    if kind not in SAMPLERS:
        raise ValueError(f"data.loader.sampler.kind={kind!r} is not a registered sampler: choose one of "
                         f"{sampler_kinds()}")
    return SAMPLERS[kind](request)


def inference_sampler(num_samples: int, world_size: int, batch_size: int, seed: int) -> Sampler:
    """Evaluation and one-pass inference: the stored order, padded, so every sample is read once."""
    return EpochPermutationSampler(num_samples, world_size, batch_size, seed=seed, shuffle=False, last_batch="pad")


register_sampler(EpochPermutationSampler.KIND, lambda r: EpochPermutationSampler(
    r.num_samples, r.world_size, r.batch_size, seed=r.seed, shuffle=True, last_batch=r.last_batch))
register_sampler(SlidingWindowSampler.KIND, lambda r: SlidingWindowSampler(
    r.num_samples, r.world_size, r.batch_size, seed=r.seed, window_size=r.settings.window_size,
    stride=r.settings.stride))
