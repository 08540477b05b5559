"""``Batch``: what every loader yields for one step of one rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GLOBAL_VIEW, SMALL_VIEW = "global", "small"


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
    """

    views: list[torch.Tensor]
    view_kinds: list[str]
    instance_ids: torch.Tensor
    valid: torch.Tensor
    global_valid: int
    step: int
    labels: torch.Tensor | None = None
    skipped: tuple[str, ...] = ()
