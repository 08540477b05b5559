"""MoCo's queue of keys, its slots split over the ranks of a group like the classifier's rows.

The queue has K slots (65,536 in MoCo v2).  Each step's global batch of keys (B_g of them, every
rank's, in the sampler's global order, which is the all-gather's rank order) is written to slots
``[pointer, pointer + B_g)`` and the pointer moves on by B_g, wrapping to 0 at K: the oldest keys are
overwritten.  K must be a multiple of B_g, so a step's keys never straddle the end of the queue.

Rank s of T holds the contiguous slots of ``trainer.classifier.sharding.ClassShard(K, T, s)`` (K need
not divide by T), and writes the part of each step's slots that falls in its range.  Which key
lands in which slot depends only on K, B_g and the steps, never on T; each slot also records the
sample id of its key (-1 until it holds one), so that this can be checked and so that a step can
tell the negatives that are its own samples.

The initial keys are random unit vectors, drawn per block of slots from the seed
(``trainer.classifier.sharded_classifier.gaussian_rows``): the same for any T.  The keys and ids are
``ShardedRows`` in the checkpoint state, so a queue saved on T ranks reloads on any other number.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.classifier.sharded_classifier import gaussian_rows
from trainer.classifier.sharding import ClassShard
from trainer.parallel.sharded_state import ShardedRows

DEFAULT_QUEUE_SIZE = 65536  # MoCo v2's K
EMPTY_SLOT = -1  # the id of a slot that holds no sample's key yet (an initial random key)


def check_queue_size(size: int, global_batch: int, field: str = "objective.queue_size") -> None:
    """Refuse a queue whose steps would straddle its end: ``size`` must be a positive multiple of
    ``global_batch`` (the batch size times the number of ranks).  ``field`` names the setting."""
    if global_batch < 1:
        raise ValueError(f"the global batch must be at least 1 sample, got {global_batch}")
    if size < global_batch or size % global_batch:
        raise ValueError(f"{field}={size} is invalid: the queue takes a whole global batch of {global_batch} keys "
                         f"per step, so it must be a positive multiple of it (e.g. "
                         f"{max(1, size // global_batch) * global_batch}); change {field} or the batch size")


class KeyQueue:
    """This rank's slots ``[slot_start, slot_end)`` of a ``size``-slot queue of ``dim``-wide keys.

    ``global_batch``: keys enqueued per step (over all ranks); ``shard_index``/``num_shards``: this
    rank's place among the ranks that split the slots; ``primary``: False on a rank whose slots
    duplicate another's (replica groups), so a checkpoint writes each slot once; ``field``: the
    setting that sets ``size``, named when it is refused.
    """

    def __init__(self, size: int, dim: int, global_batch: int, shard_index: int, num_shards: int,
                 device: torch.device | str = "cpu", seed: int = 0, primary: bool = True,
                 field: str = "objective.queue_size") -> None:
        check_queue_size(size, global_batch, field)
        self.size, self.global_batch, self.primary, self.field = size, global_batch, primary, field
        self.shard = ClassShard(size, num_shards, shard_index)
        start, count = self.shard.class_start, self.shard.num_classes_local
        self.keys = F.normalize(gaussian_rows(start, count, dim, 1.0, seed), dim=1).to(device)  # [slots, D] fp32
        self.ids = torch.full((count,), EMPTY_SLOT, dtype=torch.int64, device=device)
        self.pointer = 0  # the next global slot to write: a multiple of global_batch, the same on every rank

    @property
    def slot_start(self) -> int:
        return self.shard.class_start

    @property
    def slot_end(self) -> int:
        return self.shard.class_end

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor, ids: torch.Tensor) -> None:
        """Write one step's ``keys`` ``[global_batch, D]`` (unit vectors, every rank's in the sampler's
        global order; their gradient is not kept) and their sample ``ids`` ``[global_batch]``
        to slots ``[pointer, pointer + global_batch)``, this rank's part of them.  Call it after the
        step's backward: the loss's backward still reads the keys it scored."""
        if keys.shape[0] != self.global_batch or ids.shape != (self.global_batch,):
            raise ValueError(f"enqueue takes the whole global batch: {self.global_batch} keys and ids, got keys "
                             f"{tuple(keys.shape)} and ids {tuple(ids.shape)}")
        if keys.shape[1] != self.keys.shape[1]:
            raise ValueError(f"keys are {keys.shape[1]} wide but the queue holds {self.keys.shape[1]}-wide keys")
        first = max(self.pointer, self.slot_start)
        last = min(self.pointer + self.global_batch, self.slot_end)
        if first < last:
            local, batch = slice(first - self.slot_start, last - self.slot_start), slice(first - self.pointer,
                                                                                         last - self.pointer)
            self.keys[local] = keys[batch].to(self.keys.dtype)
            self.ids[local] = ids[batch].to(self.ids.device, torch.int64)
        self.pointer = (self.pointer + self.global_batch) % self.size

    def state_dict(self) -> dict:
        """Keys and ids as ``ShardedRows`` of all ``size`` slots (they re-split for any number of
        ranks) and the pointer."""
        return {"keys": ShardedRows(self.keys, self.slot_start, self.slot_end, self.size, self.primary),
                "ids": ShardedRows(self.ids, self.slot_start, self.slot_end, self.size, self.primary),
                "pointer": self.pointer}

    def load_state_dict(self, state: dict) -> None:
        """From ``state_dict``'s structure with this rank's rows filled in (the checkpoint's loader
        reads them for this rank's slot range, whatever the number of ranks that saved them)."""
        pointer = int(state["pointer"])
        if not 0 <= pointer < self.size or pointer % self.global_batch:
            raise ValueError(f"the checkpoint's queue pointer {pointer} is not a multiple of this run's global batch "
                             f"{self.global_batch} below {self.field}={self.size}: resume with the global batch the "
                             "checkpoint was trained with")
        for name in ("keys", "ids"):
            rows = state[name].rows
            held = getattr(self, name)
            if rows is None or rows.shape != held.shape:
                found = "none" if rows is None else tuple(rows.shape)
                raise ValueError(f"the checkpoint's queue {name} for slots [{self.slot_start}, {self.slot_end}) are "
                                 f"{found}, this run needs {tuple(held.shape)}: resume with the feature width and "
                                 f"{self.field} the checkpoint was trained with")
            held.copy_(rows.to(held.device, held.dtype))
        self.pointer = pointer
