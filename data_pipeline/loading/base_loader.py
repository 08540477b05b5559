"""What the DALI and the fallback loader share: the sample table, the sampler, the step reader,
the epoch/step bookkeeping, and turning a step's pixels into a ``Batch``.

A backend only implements ``_batches(epoch, steps)``: the views of those steps, in order, built
from ``self.reader.read(epoch, step)``.  Nothing before ``steps.start`` is read or decoded, so a
resumed run starts at its step at once and, the parameters being drawn per step, gets exactly
the batches an uninterrupted run would have had.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from data_pipeline.loading.batch import Batch
from data_pipeline.loading.device_copy import to_device
from data_pipeline.loading.loader_config import LoaderConfig
from data_pipeline.loading.sample_reader import StepReader, StepSamples
from data_pipeline.loading.samplers import SamplerRequest, inference_sampler, training_sampler
from data_pipeline.loading.samplers.base import Sampler
from data_pipeline.loading.view_layout import ViewLayout
from data_pipeline.shardset.sample_table import sample_table
from data_pipeline.storage.shard_url import ShardLocation, shard_location


def default_sampler(num_samples: int, config: LoaderConfig, world_size: int, train: bool) -> Sampler:
    """Training: the registered sampler ``config.sampler.kind`` names; evaluation: stored order,
    padded (every sample is needed exactly once)."""
    if not train:
        return inference_sampler(num_samples, world_size, config.batch_size, config.sample_seed)
    return training_sampler(SamplerRequest(num_samples, world_size, config.batch_size, config.sample_seed,
                                           config.last_batch, config.sampler))


def _refuse_data_smaller_than_a_batch(shard_dir: ShardLocation, samples: int, batch_size: int, world_size: int) -> None:
    """Every step would be mostly padding (or, dropping the last batch, there would be no step)."""
    if samples >= batch_size * world_size:
        return
    fix = (f"set data.loader.batch_size to at most {samples // world_size} (per rank) or add images"
           if samples >= world_size else "add images")
    raise ValueError(f"{shard_dir} holds {samples} samples, fewer than one global batch (data.loader.batch_size "
                     f"{batch_size} x {world_size} ranks = {batch_size * world_size}): {fix}")


class IndexedLoader:
    """Base of both backends; see ``data_pipeline.loading.loader.build_loader`` for the public contract."""

    def __init__(self, shard_dir: ShardLocation, config: LoaderConfig, rank: int, world_size: int, device: torch.device,
                 train: bool, sampler: Sampler | None = None, read_threads: int = 1) -> None:
        self.shard_dir, self.config, self.device, self.train = shard_location(shard_dir), config, device, train
        self.rank, self.world_size = rank, world_size
        table = sample_table(self.shard_dir)
        self.num_instances = table.num_samples
        if train:
            _refuse_data_smaller_than_a_batch(self.shard_dir, table.num_samples, config.batch_size, world_size)
        self.sampler = sampler if sampler is not None else default_sampler(table.num_samples, config, world_size, train)
        if (self.sampler.world_size, self.sampler.batch_size) != (world_size, config.batch_size):
            raise ValueError(
                f"{type(self.sampler).__name__} plans world_size={self.sampler.world_size}, batch_size="
                f"{self.sampler.batch_size}, the loader runs world_size={world_size}, data.loader.batch_size="
                f"{config.batch_size}; build the sampler with the loader's values"
            )
        self.steps_per_epoch = self.sampler.steps_per_epoch
        augment = config.augment if train else None
        self.reader = StepReader(table, self.sampler, rank, config.sample_seed, augment, read_threads,
                                 skip_bad_samples=config.on_bad_sample == "skip")
        self.view_layout = config.view_layout if train else ViewLayout.single(config.augment.image_size)
        self.view_kinds = list(self.view_layout.kinds)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def epoch_batches(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """Batches of steps ``[start_step, steps_per_epoch)`` of ``epoch``; earlier steps are not read."""
        if not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(f"start_step={start_step} is outside [0, {self.steps_per_epoch}] (steps per epoch)")
        steps = range(start_step, self.steps_per_epoch)
        return self._batches(epoch, steps) if steps else iter(())

    def _batches(self, epoch: int, steps: range) -> Iterator[Batch]:
        raise NotImplementedError

    def _batch(self, views: list[torch.Tensor], samples: StepSamples) -> Batch:
        """``views`` must be tensors this loader owns (DALI reuses its buffers: copy first)."""
        device = self.device
        return Batch(
            # The fallback's workers pin the views on GPUs, DALI's are there already; the ids and
            # masks are numpy arrays: pinned here so no copy makes the CPU wait for the GPU.
            views=[to_device(view, device) for view in views],
            view_kinds=list(self.view_kinds),
            instance_ids=to_device(samples.ids, device),
            valid=to_device(samples.valid, device),
            global_valid=samples.global_valid,
            step=samples.step,
            labels=None if samples.labels is None else to_device(samples.labels, device),
            skipped=samples.skipped,
            plan=samples.plan,
            next_plan=samples.next_plan,
            host_instance_ids=samples.ids,
            host_valid=samples.valid,
            reads=samples.reads,
        )
