"""The fallback loader: PIL decode and torchvision.transforms.v2 functional ops in DataLoader
worker processes; selectable with ``data.backend: torch`` and the baseline of ``instcls bench data``.

It is a map-style dataset over steps: item i is the whole batch of step ``steps[i]`` of this rank,
so workers prepare whole steps ahead in order, and starting at step k costs nothing.  It applies
the parameters of ``data_pipeline.loading.augment.view_params`` with the same operations as the DALI graph: crop
box resized with antialiased bilinear filtering, the affine colour map rounded and saturated to
uint8, the Gaussian blur with the drawn sigma and kernel window, solarize, flip, normalisation.  What
still differs is the decoders' and resamplers' arithmetic: under one grey level on average, a few
at sharp edges (``tests/integration/test_loaders.py`` holds both backends to that).

An image whose header reads but whose pixels PIL cannot decode raises ``UndecodableImageError``
(a ``ValueError``: the run exits 2) naming it by shard and key; with ``data.loader.on_bad_sample:
skip`` the worker has the reader blank it and reads the step again, so its views are drawn for the
blank image, as for any skipped sample (``StepReader``).
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms.v2 import functional as F

from data_pipeline.loading.augment.augment_config import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig
from data_pipeline.loading.augment.recipes import SOLARIZE_THRESHOLD
from data_pipeline.loading.augment.view_params import ViewParams
from data_pipeline.loading.base_loader import IndexedLoader
from data_pipeline.loading.batch import Batch
from data_pipeline.loading.fork_guard import children_leave_inherited_objects_alone
from data_pipeline.loading.sample_reader import (
    StepInputs,
    StepReader,
    StepSamples,
    UndecodableImageError,
    undecodable_message,
)
from data_pipeline.shardset.sample_table import RECREATE


def decode_rgb(data: np.ndarray, where: str) -> torch.Tensor:
    """uint8 ``[3, H, W]``; ``where`` names the sample in the error."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB")
    except Exception as error:  # PIL raises many types for bad data
        raise UndecodableImageError(f"{undecodable_message(where, error)}; {RECREATE}") from error
    return F.pil_to_tensor(rgb)


def recolour(image: torch.Tensor, colour: np.ndarray) -> torch.Tensor:
    """Apply an affine colour map ``[M | t]`` to a uint8 image, rounding and saturating like DALI."""
    affine = torch.from_numpy(colour)
    out = torch.einsum("ij,jhw->ihw", affine[:, :3], image.float()) + affine[:, 3, None, None]
    return out.round_().clamp_(0, 255).to(torch.uint8)


def solarize(image: torch.Tensor) -> torch.Tensor:
    """Every level of a uint8 image from ``SOLARIZE_THRESHOLD`` on becomes ``255 - level``."""
    return torch.where(image < SOLARIZE_THRESHOLD, image, 255 - image)


def normalise(image: torch.Tensor) -> torch.Tensor:
    return F.normalize(F.to_dtype(image, torch.float32, scale=True), IMAGENET_MEAN, IMAGENET_STD)


def augmented_view(image: torch.Tensor, view: ViewParams, index: int) -> torch.Tensor:
    """Sample ``index``'s view ``view`` of a decoded uint8 image, float32 ``[3, size, size]``."""
    top, left, height, width = view.crop[index].tolist()
    out = F.resized_crop(image, top, left, height, width, [view.size, view.size], antialias=True)
    out = recolour(out, view.colour[index])
    if view.blur[index]:
        sigma, window = float(view.sigma[index]), int(view.window[index])
        out = F.gaussian_blur(out, [window, window], [sigma, sigma])
    if view.solarize[index]:
        out = solarize(out)
    if view.flip[index]:
        out = F.horizontal_flip(out)
    return normalise(out)


def eval_view(image: torch.Tensor, augment: AugmentConfig) -> torch.Tensor:
    """The inference view: shorter side to ``image_size * eval_resize``, centre crop ``image_size``."""
    out = F.resize(image, [round(augment.image_size * augment.eval_resize)], antialias=True)
    return normalise(F.center_crop(out, [augment.image_size, augment.image_size]))


class _StepViews(Dataset):
    """Item i: the views ``[b, 3, s, s]`` of step ``steps[i]`` and its ``StepSamples``."""

    def __init__(self, reader: StepReader, epoch: int, steps: range, augment: AugmentConfig, train: bool) -> None:
        self.reader, self.epoch, self.steps, self.augment, self.train = reader, epoch, steps, augment, train

    def __len__(self) -> int:
        return len(self.steps)

    def _decoded(self, step: int) -> tuple[StepInputs, list[torch.Tensor]]:
        """The step's inputs and its images decoded; a sample that does not decode is, with
        ``skip_bad_samples``, blanked by the reader and the step read again (its views drawn anew)."""
        describe = self.reader.table.describe
        while True:
            inputs = self.reader.read(self.epoch, step)
            images, problems = [], {}
            for jpeg, sample_id in zip(inputs.jpegs, inputs.samples.ids.tolist()):
                try:
                    images.append(decode_rgb(jpeg, describe(sample_id)))
                except UndecodableImageError as error:
                    if not self.reader.skip_bad_samples:
                        raise
                    problems[sample_id] = undecodable_message(describe(sample_id), error.__cause__)
            if not problems:
                return inputs, images
            self.reader.skip_undecodable(problems)  # this worker reads them as the blank from now on

    def __getitem__(self, index: int) -> tuple[list[torch.Tensor], StepSamples]:
        inputs, images = self._decoded(self.steps[index])
        if not self.train:
            return [torch.stack([eval_view(image, self.augment) for image in images])], inputs.samples
        views = [torch.stack([augmented_view(image, view, i) for i, image in enumerate(images)])
                 for view in inputs.views]
        return views, inputs.samples


class TorchLoader(IndexedLoader):
    """See ``data_pipeline.loading.loader.build_loader``; ``num_threads`` worker processes, each a step at a time."""

    def _batches(self, epoch: int, steps: range) -> Iterator[Batch]:
        dataset = _StepViews(self.reader, epoch, steps, self.config.augment, self.train)
        self.reader.table.open_all()  # a local set's handles, opened once here, are inherited by every worker
        # Pinned host memory lets the copy to the GPU run asynchronously (see ``_batch``).
        workers = DataLoader(dataset, batch_size=None, num_workers=self.config.num_threads, prefetch_factor=2,
                             pin_memory=self.device.type == "cuda")
        batches = _forked_iterator(workers)
        try:
            for views, samples in batches:
                yield self._batch(views, samples)
        finally:
            # An error leaving this generator, or a caller that stops early, stops the worker processes now:
            # a traceback that keeps this frame would otherwise keep them alive, holding every descriptor the
            # parent had (a fork server's pipe among them, whose stop then waits forever).
            _stop_workers(batches)


def _forked_iterator(workers: DataLoader):
    """``iter(workers)``, which forks the worker processes, with the parent's objects frozen."""
    with children_leave_inherited_objects_alone():
        return iter(workers)


def _stop_workers(batches) -> None:
    """Shut down a multi-process DataLoader iterator's workers (torch's own shutdown, idempotent)."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
