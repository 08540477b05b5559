"""DALI pipelines over the WebDataset shards: nvJPEG decode on the GPU when CUDA is present
(``device="mixed"``), a CPU-only pipeline (``device_id=None``) otherwise.  One code path; the
device is chosen when the pipeline is built.

DALI facts this module relies on: the reader needs the index files and a ``name`` that the
iterator refers to (without it an epoch never ends); ``pad_last_batch`` repeats samples so every
shard yields the same number of batches; the iterator reuses its output buffers, so everything
handed out is copied first; outputs are deterministic for a given seed.  The pipeline is built per
epoch with that epoch's shard order and seeds (see ``data_pipeline.loader``), so any epoch, and any
step of it, can be replayed exactly after a restart.
"""

from __future__ import annotations

from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

from data_pipeline.augment import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig
from data_pipeline.loader import EpochLoader, LoaderConfig, epoch_seed, epoch_shard_order

READER_NAME = "Reader"
_MEAN = [255 * m for m in IMAGENET_MEAN]
_STD = [255 * s for s in IMAGENET_STD]


def _coin(probability: float):
    return fn.random.coin_flip(probability=probability, dtype=types.BOOL)


def _augmented_view(images, size: int, area: tuple[float, float], augment: AugmentConfig):
    """One SimCLR view (see ``data_pipeline.augment``); ``if`` runs as a DALI conditional."""
    images = fn.random_resized_crop(images, size=[size, size], random_area=list(area), random_aspect_ratio=[3 / 4, 4 / 3])
    brightness, contrast, saturation, hue = augment.jitter
    if _coin(augment.jitter_prob):
        images = fn.color_twist(
            images,
            brightness=fn.random.uniform(range=[1 - brightness, 1 + brightness]),
            contrast=fn.random.uniform(range=[1 - contrast, 1 + contrast]),
            saturation=fn.random.uniform(range=[1 - saturation, 1 + saturation]),
            hue=fn.random.uniform(range=[-360 * hue, 360 * hue]),  # DALI's hue is in degrees
        )
    if _coin(augment.grayscale_prob):
        images = fn.color_twist(images, saturation=0.0)  # zero chroma: the luma (grayscale) image
    if _coin(augment.blur_prob):
        images = fn.gaussian_blur(images, sigma=fn.random.uniform(range=list(augment.blur_sigma)))
    return fn.crop_mirror_normalize(
        images, dtype=types.FLOAT, output_layout="CHW", mean=_MEAN, std=_STD,
        mirror=fn.random.coin_flip(probability=augment.flip_prob),
    )


def _read(tar_paths, index_paths, shard_id, num_shards, shuffle: bool, config: LoaderConfig):
    return fn.readers.webdataset(
        paths=tar_paths,
        index_paths=index_paths,
        ext=["jpg", "id", "cls"],
        dtypes=[types.UINT8, types.INT64, types.INT64],
        shard_id=shard_id,
        num_shards=num_shards,
        random_shuffle=shuffle,
        initial_fill=config.shuffle_buffer,
        pad_last_batch=True,
        missing_component_behavior="error",
        name=READER_NAME,
    )


@pipeline_def(enable_conditionals=True)
def _train_pipeline(tar_paths, index_paths, shard_id, num_shards, decode_device, config: LoaderConfig):
    jpegs, ids, _ = _read(tar_paths, index_paths, shard_id, num_shards, True, config)
    images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB)
    views = [_augmented_view(images, size, area, config.augment) for size, area in config.augment.view_specs()]
    return (*views, ids)


@pipeline_def
def _eval_pipeline(tar_paths, index_paths, shard_id, num_shards, decode_device, config: LoaderConfig):
    jpegs, ids, labels = _read(tar_paths, index_paths, shard_id, num_shards, False, config)
    images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB)
    size = config.augment.image_size
    images = fn.resize(images, resize_shorter=round(size * config.augment.eval_resize))
    view = fn.crop_mirror_normalize(
        images, dtype=types.FLOAT, output_layout="CHW", crop=[size, size], mean=_MEAN, std=_STD
    )
    return view, ids, labels


class DaliLoader(EpochLoader):
    """Iterate once per epoch; yields ``Batch`` on ``device``."""

    def _iterator(self) -> DALIGenericIterator:
        use_gpu = self.device.type == "cuda"
        order = epoch_shard_order(len(self.manifest.shards), self.config.seed, self.epoch, shuffle=self.train)
        tars, indexes = self.manifest.tar_paths(self.shard_dir), self.manifest.index_paths(self.shard_dir)
        build = _train_pipeline if self.train else _eval_pipeline
        pipeline = build(
            tar_paths=[tars[i] for i in order],
            index_paths=[indexes[i] for i in order],
            shard_id=self.rank,
            num_shards=self.world_size,
            decode_device="mixed" if use_gpu else "cpu",
            config=self.config,
            batch_size=self.config.batch_size,
            num_threads=self.config.num_threads,
            device_id=self.device.index if use_gpu else None,
            seed=epoch_seed(self.config.seed, self.epoch, self.rank),
        )
        pipeline.build()
        outputs = [f"view{v}" for v in range(self.num_views)] + ["ids"] + ([] if self.train else ["labels"])
        policy = LastBatchPolicy.FILL if self.config.last_batch == "pad" else LastBatchPolicy.DROP
        return DALIGenericIterator(pipeline, outputs, reader_name=READER_NAME, last_batch_policy=policy)

    def __iter__(self):
        self._first_sightings.new_epoch()
        iterator = self._iterator()
        self.epoch += 1
        for outputs in iterator:
            data = outputs[0]  # buffers DALI reuses: everything handed out is a copy
            views = [data[f"view{v}"].clone() for v in range(self.num_views)]
            labels = None if self.train else data["labels"].view(-1).clone()
            yield self._batch(views, data["ids"].view(-1).clone(), labels)  # reader outputs stay on the CPU
