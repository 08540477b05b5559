"""The DALI loader: encoded images and augmentation parameters come from Python through
``fn.external_source``; DALI decodes (nvJPEG, ``device="mixed"``, when CUDA is present; the CPU
decoder with ``device_id=None`` otherwise) and does all pixel work.

Every random choice arrives as a per-sample argument input (crop box -> ``fn.resize`` ROI, colour
map -> ``fn.coord_transform``, blur flag, sigma and window -> a DALI conditional around
``fn.gaussian_blur``, solarize flag -> another around arithmetic (DALI has no solarize operator:
``solarized``), flip -> ``crop_mirror_normalize(mirror=...)``); the pipeline has no random operator, so
its output is a pure function of the step and any step can be produced first.

One pipeline (and its nvJPEG decoder, thread pool and buffers) serves every ``epoch_batches`` call
of a loader: each pass points its source at a new ``(epoch, steps)``; the source maps DALI's
iteration i to step ``steps[i]`` and raises ``StopIteration`` past the end (also for DALI's
look-ahead calls), and resetting the pipeline then restarts its iteration count at 0.  Only a pass
that ran to its end hands the pipeline back: one left half-way (the trainer stopped, an error) still
has look-ahead batches queued inside DALI, and resetting such a pipeline is not supported
(NVIDIA/DALI#4023), so the next pass builds a new one.  DALI returns batches in the order it asked
for them, so the step metadata waits in a FIFO.  The iterator reuses its output buffers, so
everything handed out is copied first.

A JPEG whose header reads but whose body does not decode fails DALI's decoder on the whole batch.
The loader then names the culprit: the sample DALI's message points at, if PIL cannot decode it
either (``_culprits``).  Without ``data.loader.on_bad_sample: skip`` it raises
``UndecodableImageError`` (a ``ValueError``: the run exits 2) naming it by shard and key.  With
``skip`` the reader remembers it (read as the blank image from then on: not valid, named in the
step's ``skipped``), and the pipeline is *rebuilt*, not reset (one whose operator raised cannot
be: NVIDIA/DALI#4023), to go on from the first step not yet handed out.  The batches are thus
those of a run that had known the culprit from the start, which is what a resumed run gets: the
blanking depends on the sample's bytes alone.  A failure on a sample PIL decodes stays a
``RuntimeError`` (not the data's fault as far as we can tell).

DALI calls a (non-parallel) source on the thread that asks for batches: the training thread,
inside ``next()``.  So the source reads ahead: the files and parameters of the next
``READ_AHEAD`` steps are read by background threads (one per step, so that on object storage their
round trips overlap) while the GPU trains, and a call only picks up a finished read.  DALI's own
parallel source (worker processes) would need a stateless, picklable callback, and this one is
pointed at a new ``(epoch, steps)`` each pass.
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import accumulate

import torch
from nvidia.dali import Pipeline, fn, pipeline_def, types
from nvidia.dali import math as dmath
from nvidia.dali.plugin.pytorch import DALIGenericIterator

from data_pipeline.loading.augment.augment_config import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig
from data_pipeline.loading.base_loader import IndexedLoader
from data_pipeline.loading.batch import Batch
from data_pipeline.loading.sample_reader import StepReader, StepSamples, UndecodableImageError
from data_pipeline.shardset.sample_table import RECREATE

_MEAN = [255 * m for m in IMAGENET_MEAN]
_STD = [255 * s for s in IMAGENET_STD]
# Per view: ROI start (y, x), ROI end (y, x), colour map [M | t], blur flag, sigma, window, mirror flag; then,
# only for a view its recipe may solarize, the solarize flag (so a recipe without solarize builds no branch for it).
_VIEW_TYPES = [types.FLOAT, types.FLOAT, types.FLOAT, types.BOOL, types.FLOAT, types.INT32, types.INT32]
_VIEW_NDIMS = [1, 1, 2, 0, 0, 0, 0]


READ_AHEAD = 3  # steps read before DALI asks for them (its own prefetch queue is 2 batches deep)


class _StepSource:
    """DALI's batch source: iteration i -> the encoded images and view parameters of ``steps[i]``,
    read ahead by a background thread (see the module docstring)."""

    def __init__(self, reader: StepReader, solarized_views: frozenset[int] = frozenset()) -> None:
        self.reader, self.solarized_views = reader, solarized_views  # views that carry a solarize flag
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (owning pid: threads do not survive a fork)
        self._reads: dict[int, Future] = {}
        self.start(epoch=0, steps=range(0))

    def start(self, epoch: int, steps: range) -> None:
        """The next pass: called before DALI asks for its first iteration (build or reset)."""
        for read in self._reads.values():  # the last pass's reads ahead: not needed any more
            read.cancel()
        self.epoch, self.steps = epoch, steps
        self.pending: deque[StepSamples] = deque()  # steps handed to DALI, not yet out of it
        self._reads = {}  # iteration -> its read, submitted ahead

    def _read_ahead(self, first: int) -> None:
        if self._pool is None or self._pool[0] != os.getpid():
            # One thread per step ahead: on object storage each step's reads wait a round trip, and the
            # steps ahead overlap their round trips instead of queueing them (their requests share the
            # reader's bounded pool).
            self._pool = (os.getpid(), ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="dali-read-ahead"))
        for iteration in range(first, min(first + READ_AHEAD, len(self.steps))):
            if iteration not in self._reads:
                self._reads[iteration] = self._pool[1].submit(self.reader.read, self.epoch, self.steps[iteration])

    def __call__(self, iteration: int) -> list:
        if iteration >= len(self.steps):
            raise StopIteration
        self._read_ahead(iteration)
        inputs = self._reads.pop(iteration).result()  # a bad sample's error is raised here, as before
        self._read_ahead(iteration + 1)
        self.pending.append(inputs.samples)
        outputs = [inputs.jpegs]
        for index, view in enumerate(inputs.views):
            top_left, height_width = view.crop[:, :2], view.crop[:, 2:]
            outputs += [top_left.astype("float32"), (top_left + height_width).astype("float32"), view.colour,
                        view.blur, view.sigma, view.window, view.flip.astype("int32")]
            if index in self.solarized_views:
                outputs.append(view.solarize)
        return outputs


def solarized(images):
    """Solarize uint8 images: a level ``x`` below ``SOLARIZE_THRESHOLD`` (128) stays, one from it on
    becomes ``255 - x``.  DALI has no such operator; at 128 the result is ``min(x, 255 - x)`` (below
    128, ``255 - x`` > 127 >= ``x``; from 128 on, ``255 - x`` <= 127 < ``x``), one arithmetic
    expression that stays uint8."""
    return dmath.min(images, types.Constant(255, dtype=types.UINT8) - images)


def solarize_where(images, flags):
    """``solarized`` on the samples whose per-sample bool ``flags`` is set (a DALI conditional)."""
    if flags:
        images = solarized(images)
    return images


def _view(images, size: int, roi_start, roi_end, colour, blur, sigma, window, mirror, solarize=None):
    images = fn.resize(images, size=[size, size], roi_start=roi_start, roi_end=roi_end)
    images = fn.coord_transform(images, MT=colour, dtype=types.UINT8)  # rounds and saturates, like the fallback
    if blur:
        images = fn.gaussian_blur(images, sigma=sigma, window_size=window)
    if solarize is not None:  # decided when the graph is built: only views the recipe may solarize
        images = solarize_where(images, solarize)
    return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=_MEAN, std=_STD,
                                    mirror=mirror)


def solarized_views(augment: AugmentConfig) -> frozenset[int]:
    """The views whose recipe probability of solarize is above 0 (``AugmentConfig.effective_recipe``)."""
    recipe = augment.effective_recipe()
    return frozenset(v for v in range(len(augment.view_specs())) if recipe.view(v).solarize > 0)


@pipeline_def(enable_conditionals=True)
def _train_pipeline(source: _StepSource, decode_device: str, augment: AugmentConfig):
    specs = augment.view_specs()
    per_view = [_VIEW_TYPES + [types.BOOL] * (v in source.solarized_views) for v in range(len(specs))]
    ndims = [_VIEW_NDIMS + [0] * (v in source.solarized_views) for v in range(len(specs))]
    jpegs, *params = fn.external_source(
        source=source, num_outputs=1 + sum(map(len, per_view)), batch=True,
        dtype=[types.UINT8] + [t for view in per_view for t in view], ndim=[1] + [n for view in ndims for n in view],
    )
    # EXIF orientation is ignored, as PIL does: crop boxes come from the header size PIL reads.
    images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB, adjust_orientation=False)
    bounds = list(accumulate(map(len, per_view), initial=0))  # where each view's inputs start
    return tuple(_view(images, size, *params[bounds[v]:bounds[v + 1]]) for v, (size, _) in enumerate(specs))


@pipeline_def
def _eval_pipeline(source: _StepSource, decode_device: str, augment: AugmentConfig):
    jpegs = fn.external_source(source=source, num_outputs=1, batch=True, dtype=[types.UINT8], ndim=[1])[0]
    images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB, adjust_orientation=False)
    size = augment.image_size
    images = fn.resize(images, resize_shorter=round(size * augment.eval_resize))
    return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", crop=[size, size], mean=_MEAN,
                                    std=_STD)


class DaliLoader(IndexedLoader):
    """See ``data_pipeline.loading.loader.build_loader``; Python reads files with ``num_threads`` threads."""

    # A built pipeline and its source, left by the last pass that ran to its end (None: build one).
    _idle: tuple[Pipeline, _StepSource] | None = None
    pipelines_built = 0  # observable by tests: one per loader unless a pass was abandoned

    def _pipeline(self) -> tuple[Pipeline, _StepSource]:
        if self._idle is not None:
            idle, self._idle = self._idle, None
            return idle
        use_gpu = self.device.type == "cuda"
        device_id = None  # DALI's CPU-only mode
        if use_gpu:
            device_id = torch.cuda.current_device() if self.device.index is None else self.device.index
        source = _StepSource(self.reader, solarized_views(self.config.augment) if self.train else frozenset())
        build = _train_pipeline if self.train else _eval_pipeline
        pipeline = build(
            source=source, decode_device="mixed" if use_gpu else "cpu", augment=self.config.augment,
            batch_size=self.config.batch_size, num_threads=self.config.num_threads,
            device_id=device_id, prefetch_queue_depth=self.config.prefetch_depth,
        )
        pipeline.build()
        self.pipelines_built += 1
        return pipeline, source

    def _batches(self, epoch: int, steps: range) -> Iterator[Batch]:
        while steps:
            steps = yield from self._pass(epoch, steps)

    def _pass(self, epoch: int, steps: range) -> Generator[Batch, None, range]:
        """One pipeline's batches of ``steps``; returns the steps still to run (empty: the pass ran
        to its end) when the decoder failed on samples now skipped (see the module docstring)."""
        pipeline, source = self._pipeline()
        source.start(epoch, steps)  # before the iterator's first run asks for iteration 0
        names = [f"view{v}" for v in range(len(self.view_kinds))]
        outputs = DALIGenericIterator(pipeline, names, auto_reset=False)
        while True:
            try:
                data = next(outputs)[0]
            except StopIteration:
                # The whole pass was read: the pipeline can serve the next one.  Not the iterator's
                # reset(): it would schedule the next pass's first runs before start() moves the source.
                pipeline.reset()
                self._idle = pipeline, source
                return range(0)
            except RuntimeError as error:  # a DALI operator failed on a step it was given
                if not source.pending:
                    raise
                first = source.pending[0].step
                self._skip_culprits(epoch, list(source.pending), error)
                source.start(epoch, range(0))  # drop its reads ahead; this pipeline is not reused
                return range(first, steps.stop)
            views = [data[name].clone() for name in names]  # DALI reuses these buffers
            yield self._batch(views, source.pending.popleft())

    def _skip_culprits(self, epoch: int, pending: list[StepSamples], error: RuntimeError) -> None:
        """Name the samples DALI's decoder failed on (``_culprits``) and have the reader blank them
        from now on; raise when skipping is off, or when none of them fails PIL too."""
        found = _culprits(self.reader, pending, error)
        if found is None:
            steps = ", ".join(str(samples.step) for samples in pending)
            raise RuntimeError(f"DALI failed on epoch {epoch} step(s) {steps}, and PIL decodes the samples it names "
                               f"(or, naming none, every sample of them); DALI said: {_dali_reason(error)}") from error
        step, problems = found
        if not self.reader.skip_bad_samples:
            raise UndecodableImageError(
                f"DALI failed on epoch {epoch} step {step}: {next(iter(problems.values()))}; {RECREATE}, or set "
                f"data.loader.on_bad_sample: skip to go on without it; DALI said: {_dali_reason(error)}"
            ) from error
        self.reader.skip_undecodable(problems)


_REFUSED_SAMPLE = re.compile(r"Failed to decode sample #(\d+)")


def _culprits(reader: StepReader, pending: list[StepSamples], error: RuntimeError) -> tuple[int, dict[int, str]] | None:
    """``(step, {id: why})``: the samples behind DALI's failure, or None if it names one PIL decodes, or
    names none and PIL decodes every sample of ``pending``.

    DALI hands batches out in order and fails at the failed batch's turn, so ``pending[0]`` (the
    oldest step it was given and has not handed out) is the step that failed, and the decoder's
    message names the sample's place in its batch.  That sample is the culprit if PIL fails on it
    too: a sample is skipped only when both decoders refuse its bytes, never for a failure PIL
    cannot see (a GPU decoder's transient error).  A message without the place (another DALI
    version): every sample PIL refuses in the first pending step that has one.
    """
    refused = _REFUSED_SAMPLE.search(str(error))
    failed = pending[0]
    if refused is not None and int(refused.group(1)) < len(failed.ids):
        sample_id = int(failed.ids[int(refused.group(1))])
        problem = reader.pixels_problem(sample_id)
        return None if problem is None else (failed.step, {sample_id: problem})
    for samples in pending:
        problems = reader.undecodable(samples)
        if problems:
            return samples.step, problems
    return None


def _dali_reason(error: RuntimeError) -> str:
    """The operator's own message from DALI's multi-line error (after its pipeline traceback)."""
    text = str(error)
    lines = [line.strip() for line in text.split("encountered:", 1)[-1].splitlines() if line.strip()]
    return lines[0] if lines else text
