"""What a whole job asks of its shard store, from one rank's measured reads: ``ranks`` ranks each
training at ``images_per_s`` read that many samples a second, each costing the requests per sample
the bench counted (one ranged GET on ``s3://``, one ``pread`` on disk) and the set's mean image bytes
(the sample table's ``size`` column).  An epoch of a data set is then its images over the job's rate."""

from __future__ import annotations

from dataclasses import asdict, dataclass

MB = 1e6  # decimal megabytes: what object stores bill and network links are rated in
# An assumption, not a measurement here: ImageNet's JPEGs average about 110 KB (ILSVRC-2012's training
# split is ~138 GB over 1,281,167 images, 108 KB each), the size a real job's requests carry.
ASSUMED_IMAGENET_MEAN_BYTES = 110_000


@dataclass(frozen=True)
class StoreDemand:
    ranks: int
    images_per_s_per_rank: float
    requests_per_sample: float
    mean_image_bytes: float

    @property
    def images_per_s(self) -> float:
        return self.ranks * self.images_per_s_per_rank

    @property
    def requests_per_s(self) -> float:
        return self.images_per_s * self.requests_per_sample

    @property
    def mb_per_s(self) -> float:
        return self.images_per_s * self.mean_image_bytes / MB

    def epoch_seconds(self, images: int) -> float:
        return images / self.images_per_s

    def epoch_terabytes(self, images: int) -> float:
        return images * self.mean_image_bytes / 1e12

    def summary(self, epoch_images: int) -> dict:
        return dict(asdict(self), images_per_s=self.images_per_s, requests_per_s=self.requests_per_s,
                    mb_per_s=self.mb_per_s, epoch_images=epoch_images, epoch_seconds=self.epoch_seconds(epoch_images),
                    epoch_requests=epoch_images * self.requests_per_sample,
                    epoch_terabytes=self.epoch_terabytes(epoch_images))


def rank_headroom(read_samples_per_s: float, images_per_s_per_rank: float) -> float:
    """How many times one rank's need the measured bytes-only read rate covers."""
    return read_samples_per_s / images_per_s_per_rank
