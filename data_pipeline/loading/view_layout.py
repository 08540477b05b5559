"""``ViewLayout``: how the views of a step are laid out, decided once when the job is built.

A training step has ``num_views`` augmented views of each of the ``b`` local samples, global
(large) views first, then multi-crop's small ones.  Every consumer reads the order from here:
the loader emits the views in it, the trainer runs views of one size through one forward pass,
and the losses lay features out as ``[views, b]`` on a rank and ``[ranks, views, b]`` after the
classifier group's all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data_pipeline.loading.augment.augment_config import AugmentConfig

GLOBAL_VIEW, SMALL_VIEW = "global", "small"


@dataclass(frozen=True)
class ViewLayout:
    """``kinds``: ``"global"``/``"small"`` per view, global first; ``sides``: each view's side in pixels."""

    kinds: tuple[str, ...]
    sides: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.kinds or len(self.kinds) != len(self.sides):
            raise ValueError(f"a view layout needs one side per view (kinds {self.kinds}, sides {self.sides})")
        if GLOBAL_VIEW in self.kinds[self.global_views:]:
            raise ValueError(f"global views must come first (kinds {self.kinds})")

    @classmethod
    def of_training(cls, augment: AugmentConfig) -> ViewLayout:
        """The training loader's views: ``num_views`` global views, then ``small_crops`` small ones."""
        kinds = (GLOBAL_VIEW,) * augment.num_views + (SMALL_VIEW,) * augment.small_crops
        sides = (augment.image_size,) * augment.num_views + (augment.small_size,) * augment.small_crops
        return cls(kinds, sides)

    @classmethod
    def single(cls, side: int = 0) -> ViewLayout:
        """One global view (inference; objectives tested without a loader)."""
        return cls((GLOBAL_VIEW,), (side,))

    @property
    def num_views(self) -> int:
        return len(self.kinds)

    @property
    def global_views(self) -> int:
        return sum(kind == GLOBAL_VIEW for kind in self.kinds)

    def forward_groups(self) -> list[list[int]]:
        """Views of one side, which share a forward pass (multi-crop runs two), in view order."""
        groups: dict[int, list[int]] = {}
        for index, side in enumerate(self.sides):
            groups.setdefault(side, []).append(index)
        return list(groups.values())

    def per_view(self, values: torch.Tensor) -> torch.Tensor:
        """``[b]`` per-sample values repeated for the rank's ``[views, b]`` feature rows."""
        return values.repeat(self.num_views)

    def group_columns(self, per_rank: np.ndarray, first_rank: int, ranks: int) -> np.ndarray:
        """``[ranks * views * b]`` columns of a classifier group's gathered batch (rank by rank, each
        rank's views in turn) from ``per_rank`` ``[world, b]`` host values of every rank."""
        return np.concatenate([np.tile(per_rank[r], self.num_views) for r in range(first_rank, first_rank + ranks)])
