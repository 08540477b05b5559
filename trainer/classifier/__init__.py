"""The N-way instance classifier: class sharding, distributed chunked softmax CE, the module."""

from trainer.classifier.config import ClassifierConfig
from trainer.classifier.module import ShardedCosineClassifier, gaussian_rows
from trainer.classifier.sharding import ClassShard, all_shards
from trainer.classifier.hard_negatives import HardNegativeIndex
from trainer.classifier.kernel import KernelSettings, sharded_cosine_ce
from trainer.classifier.losses import SmoothingForm
from trainer.classifier.validation import ClassifierInputError

__all__ = [
    "ClassShard",
    "ClassifierConfig",
    "ClassifierInputError",
    "ShardedCosineClassifier",
    "HardNegativeIndex",
    "KernelSettings",
    "SmoothingForm",
    "all_shards",
    "gaussian_rows",
    "sharded_cosine_ce",
]
