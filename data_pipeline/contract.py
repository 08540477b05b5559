"""What the trainer's library (models, classifier, objectives, config, checkpoints, evaluation, the
training loop) may use of the data pipeline: the types that cross the seam and the one call that
builds a loader.  Everything else in data_pipeline is its own business; tests/unit/test_layers.py
holds the rule.  (The CLI, benchmarks and drills make shards and may import any of it.)"""

from data_pipeline.loading.augment.augment_config import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig
from data_pipeline.loading.augment.recipes import DEFAULT_RECIPE
from data_pipeline.loading.base_loader import IndexedLoader
from data_pipeline.loading.batch import Batch
from data_pipeline.loading.device_copy import to_device
from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.loader_config import LoaderConfig, SamplerConfig
from data_pipeline.loading.samplers.base import Sampler, StepIndices
from data_pipeline.loading.samplers.epoch_permutation import EpochPermutationSampler
from data_pipeline.loading.view_layout import ViewLayout
from data_pipeline.shardset.manifest import MANIFEST_NAME, ShardManifest
from data_pipeline.shardset.sample_table import SampleTable, sample_table
from data_pipeline.shardset.set_files import has_manifest, load_manifest, manifest_bytes, manifest_sha256
from data_pipeline.storage.read_stats import read_stats
from data_pipeline.storage.shard_url import S3Url, ShardLocation, shard_location
from data_pipeline.storage.storage_errors import StorageAccessError, StorageUnavailableError
from data_pipeline.storage.storage_settings import StorageSettings, use_storage_settings

__all__ = ["DEFAULT_RECIPE", "IMAGENET_MEAN", "IMAGENET_STD", "MANIFEST_NAME", "AugmentConfig", "Batch",
           "EpochPermutationSampler", "IndexedLoader", "LoaderConfig", "S3Url", "Sampler", "SamplerConfig",
           "SampleTable", "ShardLocation", "ShardManifest", "StepIndices", "StorageAccessError", "StorageSettings",
           "StorageUnavailableError", "ViewLayout", "build_loader", "has_manifest", "load_manifest", "manifest_bytes",
           "manifest_sha256", "read_stats", "sample_table", "shard_location", "to_device", "use_storage_settings"]
