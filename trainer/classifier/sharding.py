"""Contiguous class ranges per shard, with the remainder spread over the first shards.

Shard ``s`` of ``T`` owns ``N // T + (s < N % T)`` classes starting at ``class_start``.  Because the
split depends only on (N, T), a checkpoint written with T shards can be re-split for any T' by
class range, and a weight row initialised from its *global* index is the same under any T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClassShard:
    """The class range ``[class_start, class_end)`` that shard ``shard_index`` of ``num_shards`` owns."""

    num_classes: int
    num_shards: int
    shard_index: int

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index {self.shard_index} is outside [0, {self.num_shards})")
        if self.num_classes < self.num_shards:
            raise ValueError(
                f"num_classes={self.num_classes} is smaller than the {self.num_shards} classifier "
                "shards; every shard needs at least one class, so use fewer classifier ranks "
                "(classifier_parallel_size) or more instances."
            )

    @property
    def _base(self) -> int:
        return self.num_classes // self.num_shards

    @property
    def _remainder(self) -> int:
        return self.num_classes % self.num_shards

    @property
    def num_classes_local(self) -> int:
        return self._base + (self.shard_index < self._remainder)

    @property
    def class_start(self) -> int:
        return self.shard_index * self._base + min(self.shard_index, self._remainder)

    @property
    def class_end(self) -> int:
        return self.class_start + self.num_classes_local

    def owner_of(self, class_ids: torch.Tensor) -> torch.Tensor:
        """Index of the shard that owns each global class id (same shape as ``class_ids``)."""
        base, remainder = self._base, self._remainder
        # The first `remainder` shards hold base + 1 classes each; ids past them are in base-sized shards.
        big_span = remainder * (base + 1)
        in_big = class_ids < big_span
        return torch.where(
            in_big,
            torch.div(class_ids, base + 1, rounding_mode="floor"),
            remainder + torch.div(class_ids - big_span, base, rounding_mode="floor"),
        )

    def is_local(self, class_ids: torch.Tensor) -> torch.Tensor:
        """Boolean mask of the ids this shard owns."""
        return (class_ids >= self.class_start) & (class_ids < self.class_end)


def all_shards(num_classes: int, num_shards: int) -> list[ClassShard]:
    """Every shard of an N-way classifier split ``num_shards`` ways, in order."""
    return [ClassShard(num_classes, num_shards, index) for index in range(num_shards)]
