"""One step of one rank, prepared in Python from ``(epoch, step)`` alone: the sampler's ids, the
encoded images read by offset, and every augmentation parameter.  Both loader backends start from
this, so they read the same samples and apply the same parameters; only decoding and pixel work
differ (DALI graph vs PIL + torchvision)."""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cache

import numpy as np
from PIL import Image, UnidentifiedImageError

from data_pipeline.loading.augment.augment_config import AugmentConfig
from data_pipeline.loading.augment.view_params import ViewParams, augmentation_rng, draw_views, image_size
from data_pipeline.loading.samplers.base import Sampler, StepIndices
from data_pipeline.shardset.sample_table import RECREATE, SampleTable, ShardReadError
from data_pipeline.storage.read_stats import ReadTally, StatsSnapshot, tallying
from data_pipeline.storage.storage_errors import BucketNotFoundError, StorageAccessError

BLANK_SIDE = 32


class UndecodableImageError(ValueError):
    """A sample's image header reads, but its pixels do not decode (a body damaged after validation).
    A ``ValueError``: the command line reports it in one line and exits ``BAD_INPUT`` (2)."""


def undecodable_message(where: str, error: Exception) -> str:
    """``"<tar> key <key>: .jpg does not decode (why)"``: both backends name such a sample alike."""
    return f"{where}: .jpg does not decode ({type(error).__name__}: {error})"


@cache
def _blank_jpeg() -> np.ndarray:
    """What a skipped sample's image is replaced by: mid-grey, so its views stay finite."""
    encoded = io.BytesIO()
    Image.new("RGB", (BLANK_SIDE, BLANK_SIDE), (128, 128, 128)).save(encoded, format="JPEG")
    return np.frombuffer(encoded.getvalue(), dtype=np.uint8)


@dataclass(frozen=True)
class StepSamples:
    """Who is in the step: ``ids`` int64 ``[b]`` and ``valid`` bool ``[b]`` of this rank,
    ``global_valid`` over all ranks, ``labels`` int64 ``[b]`` (evaluation only); ``plan``: the
    sampler's ids and valid marks of every rank; ``next_plan``: the next step's (training only)."""

    step: int
    ids: np.ndarray
    valid: np.ndarray
    global_valid: int
    labels: np.ndarray | None
    plan: StepIndices
    next_plan: StepIndices | None
    skipped: tuple[str, ...] = ()  # unreadable samples replaced by a blank image and marked not valid
    reads: StatsSnapshot | None = None  # what reading the step asked of the store (requests, bytes, latencies)


@dataclass(frozen=True)
class StepInputs:
    """``samples`` plus the encoded images (uint8 arrays) and, when training, each view's parameters."""

    samples: StepSamples
    jpegs: list[np.ndarray]
    views: list[ViewParams]


class StepReader:
    """Turns ``(epoch, step)`` into ``StepInputs`` for one rank.

    ``read_threads > 1`` reads the images of a step concurrently (``os.pread`` and an S3 client's
    socket reads release the GIL), which hides per-request latency on network and object storage
    when one process feeds a fast GPU decoder.  An ``s3://`` set's reads run on its store's pool of
    ``data.storage.max_in_flight`` threads, one per process, which every reader of it shares.

    With ``skip_bad_samples`` a sample is blanked (``_blank_jpeg``, not valid, named in ``skipped``)
    when its bytes cannot be read or have no image header, and also once a decoder found that its
    body does not decode (``skip_undecodable``): from then on every read of it returns the blank.
    Whether a sample is blank therefore depends only on its bytes, never on when it was found.
    """

    def __init__(self, table: SampleTable, sampler: Sampler, rank: int, seed: int, augment: AugmentConfig | None,
                 read_threads: int = 1, skip_bad_samples: bool = False) -> None:
        self.table, self.sampler, self.rank, self.seed, self.augment = table, sampler, rank, seed, augment
        self.read_threads, self.skip_bad_samples = read_threads, skip_bad_samples
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (owning pid: threads do not survive a fork)
        self.undecodable_ids: dict[int, str] = {}  # id -> why: bodies a decoder failed on, read as the blank

    def __getstate__(self) -> dict:
        """A DataLoader worker started by spawn or forkserver gets the reader pickled: its threads are
        made there."""
        return {**self.__dict__, "_pool": None}

    def _map(self, function, items, tally: ReadTally) -> list:
        """``function`` over ``items`` on the read threads, their store reads counted into ``tally``."""
        def counted(item):
            with tallying(tally):
                return function(item)

        shared = self.table.store.executor()  # object storage: one bounded pool per process and store
        if shared is not None:
            return list(shared.map(counted, items))
        if self.read_threads <= 1:
            return [counted(item) for item in items]
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), ThreadPoolExecutor(self.read_threads, thread_name_prefix="shard-read"))
        return list(self._pool[1].map(counted, items))

    def _samples(self, epoch: int, step: int, tally: ReadTally) -> StepSamples:
        indices = self.sampler.step(epoch, step)
        ids, valid = indices.ids[self.rank], indices.valid[self.rank]
        out_of_range = ids[(ids < 0) | (ids >= self.table.num_samples)]
        if out_of_range.size:
            raise ValueError(f"{type(self.sampler).__name__} named ids {out_of_range[:5].tolist()} at epoch {epoch} "
                             f"step {step}, outside the shard set's [0, {self.table.num_samples})")
        training = self.augment is not None
        labels = None if training else np.array(self._map(self._label, ids, tally), dtype=np.int64)
        return StepSamples(step, ids.astype(np.int64), valid.astype(bool), indices.global_valid, labels, indices,
                           self._following(epoch, step) if training else None)

    def _following(self, epoch: int, step: int):
        """The sampler's plan of the step after ``(epoch, step)``: the sequence runs on across epochs."""
        if step + 1 < self.sampler.steps_per_epoch:
            return self.sampler.step(epoch, step + 1)
        return self.sampler.step(epoch + 1, 0)

    def _label(self, sample_id: int) -> int:
        try:
            return self.table.read_label(sample_id)
        except ShardReadError:
            if not self.skip_bad_samples:
                raise
            return -1  # its image read fails too and marks the sample not valid

    def _sized_jpeg(self, sample_id: int) -> tuple[np.ndarray, tuple[int, int]]:
        data = self.table.read_jpeg(sample_id)
        try:
            size = image_size(data)
        except Exception as error:  # PIL raises many types for bad data
            unknown = isinstance(error, UnidentifiedImageError)
            reason = "no known image header" if unknown else f"{type(error).__name__}: {error}"
            raise ValueError(f"{self.table.describe(sample_id)}: .jpg is not a readable image ({reason}); "
                             f"{RECREATE}") from error
        return np.frombuffer(data, dtype=np.uint8), size

    def _sized_jpeg_or_blank(self, sample_id: int) -> tuple[np.ndarray, tuple[int, int], str | None]:
        """``_sized_jpeg``, or with ``skip_bad_samples`` a blank image and why the sample was skipped."""
        known = self.undecodable_ids.get(sample_id)
        if known is not None:
            return _blank_jpeg(), (BLANK_SIDE, BLANK_SIDE), known
        try:
            return (*self._sized_jpeg(sample_id), None)
        except (StorageAccessError, BucketNotFoundError):
            raise  # the store's fault, not the sample's: skipping would blank every sample
        except (ShardReadError, ValueError) as error:
            if not self.skip_bad_samples:
                raise
            return _blank_jpeg(), (BLANK_SIDE, BLANK_SIDE), str(error).split("; ")[0]

    def read(self, epoch: int, step: int) -> StepInputs:
        """The step's inputs, with what reading them asked of the store (``samples.reads``: counted in the
        process that reads, a DataLoader worker included, exactly while other steps read beside it,
        and carried to the trainer with the batch)."""
        tally = ReadTally()
        samples = self._samples(epoch, step, tally)
        jpegs, sizes, problems = zip(*self._map(self._sized_jpeg_or_blank, samples.ids.tolist(), tally))
        if any(problems):
            valid = samples.valid & np.array([problem is None for problem in problems])
            samples = replace(samples, valid=valid, skipped=tuple(p for p in problems if p))
        views = []
        if self.augment is not None:
            heights, widths = np.array(sizes, dtype=np.int64).T
            views = draw_views(augmentation_rng(self.seed, epoch, samples.ids), heights, widths, self.augment)
        return StepInputs(replace(samples, reads=tally.snapshot()), list(jpegs), views)

    def pixels_problem(self, sample_id: int) -> str | None:
        """``undecodable_message`` when the sample's header reads but PIL cannot decode its pixels;
        None when it decodes, and for a sample the read blanks (unreadable, no header, known bad):
        that one never reaches a decoder."""
        if sample_id in self.undecodable_ids:
            return None
        try:
            data = self.table.read_jpeg(sample_id)
            image_size(data)
        except Exception:  # noqa: BLE001 - unreadable or headerless: the read blanks it or stops first
            return None
        try:
            with Image.open(io.BytesIO(data)) as image:
                image.load()
        except Exception as error:  # PIL raises many types for bad data
            return undecodable_message(self.table.describe(sample_id), error)
        return None

    def undecodable(self, samples: StepSamples) -> dict[int, str]:
        """Every sample of a step with a ``pixels_problem``, each once: id -> the problem (for
        turning a decoder's failure on a whole batch into the names of its culprits)."""
        problems = {i: self.pixels_problem(i) for i in dict.fromkeys(samples.ids.tolist())}  # padding: once
        return {sample_id: problem for sample_id, problem in problems.items() if problem is not None}

    def skip_undecodable(self, problems: dict[int, str]) -> None:
        """With ``skip_bad_samples``: read the samples of ``problems`` (id -> why) as the blank from now on."""
        if not self.skip_bad_samples:
            raise ValueError("undecodable samples are blanked only with data.loader.on_bad_sample: skip")
        self.undecodable_ids.update(problems)
