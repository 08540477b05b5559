"""The global batch of a job is fixed at its first start and kept when it resumes on another number
of ranks (an elastic restart after a lost node, or a node back): the per-rank batch becomes
``global_batch / world_size``.

Keeping the global batch keeps everything that depends on it: the learning rate (scaled from
``optim.base_batch``), the steps of an epoch and so the schedule, and the samples of every step
(the sampler reads step k's global batch from one permutation however many ranks share it).  A
world size that does not divide the global batch is refused: no split would read the same samples.

An elastic launch (``--nnodes MIN:MAX``) fixes it at its largest size: ``data.loader.batch_size`` is
the per-rank batch at MAX nodes, whatever size the first start has.

The per-rank batch grows when the job shrinks (2 nodes of 64 images per rank, one node lost: 128
per rank), so plan a GPU job's memory at its smallest world size (``instcls plan --ranks``).
Gradient accumulation, which would keep the per-rank batch, is not implemented: the classifier's
rows step once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass


class GlobalBatchError(ValueError):
    """The job's global batch cannot be split over this many ranks."""


@dataclass(frozen=True)
class BatchSplit:
    global_batch: int
    world_size: int
    per_rank: int
    configured_per_rank: int  # data.loader.batch_size
    saved_world_size: int | None  # the ranks of the checkpoint resumed, None on a first start

    @property
    def changed(self) -> bool:
        return self.per_rank != self.configured_per_rank

    def describe(self) -> str:
        source = ("the job's" if self.saved_world_size is None
                  else f"the checkpoint's (written by {self.saved_world_size} ranks)")
        line = f"global batch {self.global_batch}, {source}: {self.world_size} ranks x {self.per_rank} images"
        if self.changed:
            line += (f" (data.loader.batch_size is {self.configured_per_rank}; the per-rank batch follows the "
                     "world size)")
        return line


def split_global_batch(configured_per_rank: int, world_size: int, saved_global_batch: int | None = None,
                       saved_world_size: int | None = None, largest_world_size: int | None = None) -> BatchSplit:
    """The per-rank batch on ``world_size`` ranks: the checkpoint's global batch split evenly, or on
    a first start ``configured_per_rank`` on each rank.  ``largest_world_size``: an elastic launch's
    largest size, at which ``configured_per_rank`` applies: a first start on fewer ranks splits the
    same global batch (``configured_per_rank x largest_world_size``), so the job's global batch does
    not depend on how many nodes had joined when it first started.  A resume on the checkpoint's own
    world size with another configured batch is refused: the user changed the batch, the world did
    not."""
    batch_ranks = largest_world_size or world_size  # the ranks data.loader.batch_size is per
    configured_global = configured_per_rank * batch_ranks
    if saved_world_size == world_size and saved_global_batch not in (None, configured_global):
        # The same ranks, another batch: the user changed the batch, which no resume can honour.
        raise GlobalBatchError(
            f"cannot resume with data.loader.batch_size={configured_per_rank} (a global batch of {configured_global}): "
            f"the checkpoint was written on these same {world_size} ranks with a global batch of {saved_global_batch}, "
            "and another global batch would change the learning rate, the schedule and the samples of every step. "
            f"Set data.loader.batch_size={saved_global_batch // batch_ranks} to resume, "
            "or start a new run for the new batch (--resume none, or another checkpoint.dir)")
    if saved_global_batch is None and largest_world_size is not None:
        saved_global_batch = configured_global
    if saved_global_batch is None:
        return BatchSplit(configured_per_rank * world_size, world_size, configured_per_rank, configured_per_rank, None)
    if saved_global_batch % world_size:
        divisors = [n for n in range(1, saved_global_batch + 1) if saved_global_batch % n == 0]
        fewer = max(n for n in divisors if n < world_size)
        more = [n for n in divisors if n > world_size][:1]
        near = " or ".join(map(str, [fewer, *more]))
        raise GlobalBatchError(
            f"cannot resume on {world_size} ranks: the job's global batch {saved_global_batch} (written by "
            f"{saved_world_size} ranks) does not split evenly over them, and another global batch would change the "
            f"learning rate, the schedule and the samples of every step. Run on a number of ranks that divides "
            f"{saved_global_batch} (the nearest: {near}), or start a new run (--resume none)")
    return BatchSplit(saved_global_batch, world_size, saved_global_batch // world_size, configured_per_rank,
                      saved_world_size)
