"""One part's share of a listing: the images its shards hold, found without keeping the rest.

The seeded order of the whole listing decides every shard (``make_shards``): shard j holds
positions ``[j*S, (j+1)*S)`` of it, and part I of K writes shards I, I + K, ...  So a part needs
the order once (4 bytes per listed image, freed before any shard is written), cuts its shards'
positions out of it, and asks the source for those images only.  A source too large to hold (a
folder or list of 14.2M files: ``sources.files.FileListing``) streams its listing and keeps the
entries asked for (its ``share``); any other is indexed.  A part's memory is then its share of the
listing, O(N / K), beside the order while it is cut; one part of one holds the whole listing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data_pipeline.ingest.ingest_state import Part
from data_pipeline.ingest.sources.generated import Source, SourceImage


def seeded_order(count: int, seed: int) -> np.ndarray:
    """``np.random.default_rng(seed).permutation(count)``, in int32 when the count fits (half the
    memory; the shuffle draws the same numbers whatever the array's dtype, so the order is the same)."""
    order = np.arange(count, dtype=np.int32 if count < 2**31 else np.int64)
    np.random.default_rng(seed).shuffle(order)
    return order


def share_of(images, positions: np.ndarray) -> Sequence[SourceImage]:
    """The images at listing ``positions`` (ascending), in that order."""
    share = getattr(images, "share", None)
    if share is not None:
        return share(positions)
    return [images[int(position)] for position in positions]


@dataclass(frozen=True)
class PartListing:
    """Attributes: count (images listed in all), num_shards (in all), sha256 (the listing's digest),
    part, images (this part's, in listing order), and per shard of this part, in stored order, the
    indexes into ``images`` of its samples (``local``, cut at ``offsets``)."""

    count: int
    num_shards: int
    sha256: str
    part: Part
    images: Sequence[SourceImage]
    local: np.ndarray
    offsets: np.ndarray

    def shard_images(self, number: int) -> list[SourceImage]:
        """Shard ``number``'s images (a shard of this part), in stored order."""
        slot, other = divmod(number - self.part.index, self.part.count)
        if other or not 0 <= slot < len(self.offsets) - 1:
            raise ValueError(f"shard {number} is not one of part {self.part}'s shards")
        return [self.images[int(index)] for index in self.local[self.offsets[slot]: self.offsets[slot + 1]]]


def list_part(source: Source, samples_per_shard: int, seed: int, part: Part) -> PartListing:
    """``part``'s share of ``source``, cut into shards of ``samples_per_shard`` in the ``seed``'s order."""
    count = len(source.images)
    num_shards = -(-count // samples_per_shard)
    order = seeded_order(count, seed)
    pieces = [order[number * samples_per_shard: (number + 1) * samples_per_shard]
              for number in part.shards(num_shards)]
    offsets = np.cumsum([0] + [len(piece) for piece in pieces])
    mine = np.concatenate(pieces) if pieces else np.empty(0, dtype=order.dtype)
    del order, pieces  # the copies in ``mine`` are all this part keeps
    positions = np.sort(mine)
    local = np.searchsorted(positions, mine).astype(mine.dtype)
    del mine
    images = share_of(source.images, positions)
    # After the share: a streamed listing finishes its digest in the pass that reads the share.
    return PartListing(count, num_shards, source.listing_sha256(), part, images, local, offsets)
