"""``Batch``: what every loader yields for one step of one rank."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data_pipeline.loading.samplers.base import StepIndices
from data_pipeline.storage.read_stats import StatsSnapshot


@dataclass
class Batch:
    """Attributes:
    views: float32 NCHW tensors on the loader's device, normalised; global views first.
    view_kinds: ``"global"`` or ``"small"`` per entry of ``views`` (evaluation: one ``"global"``).
    instance_ids: int64 ``[b]``, the sampler's ids for this rank.
    valid: bool ``[b]``, False on padding repeats (each id is valid once per epoch).
    global_valid: valid samples of this step over all ranks (from the sampler, no communication),
        the denominator of a loss averaged over real samples.
    step: the step of the epoch this batch is.
    labels: int64 ``[b]`` semantic labels, -1 when unknown; only from evaluation loaders.
    skipped: unreadable samples this step skipped (``data.loader.on_bad_sample: skip``), each named
        by shard, key and reason; they are in ``instance_ids`` but not ``valid``.
    plan: the sampler's ids and valid marks of every rank this step (host arrays, no communication).
    next_plan: the same for the step that follows (the next epoch's first after the last step of
        an epoch), so that an objective can prefetch; None for evaluation loaders.
    host_instance_ids, host_valid: ``instance_ids`` and ``valid`` as numpy arrays on the host, for
        code that needs their values without waiting for the device (per-id logs).
    reads: what reading the step's samples asked of the shard store (``StatsSnapshot``: requests,
        bytes, opens, retries, errors, each request's latency), for the trainer's metrics.
    """

    views: list[torch.Tensor]
    view_kinds: list[str]
    instance_ids: torch.Tensor
    valid: torch.Tensor
    global_valid: int
    step: int
    labels: torch.Tensor | None = None
    skipped: tuple[str, ...] = ()
    plan: StepIndices | None = None
    next_plan: StepIndices | None = None
    host_instance_ids: np.ndarray | None = None
    host_valid: np.ndarray | None = None
    reads: StatsSnapshot | None = None
