"""The N-way instance classifier: class sharding, distributed chunked softmax CE, the module."""

from trainer.classifier.classifier_config import ClassifierConfig, ClassifierSettings, HeadSettings
from trainer.classifier.hard_negatives import HardNegativeIndex
from trainer.classifier.head import CosineHead
from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce
from trainer.classifier.kernel.losses import SmoothingForm
from trainer.classifier.sharded_classifier import ShardedCosineClassifier, gaussian_rows
from trainer.classifier.sharding import ClassShard, all_shards
from trainer.classifier.terms.chunk_term import ChunkTerm, KernelPass
from trainer.classifier.validation import ClassifierInputError

__all__ = [
    "ChunkTerm",
    "ClassShard",
    "ClassifierConfig",
    "ClassifierSettings",
    "CosineHead",
    "HeadSettings",
    "KernelPass",
    "ClassifierInputError",
    "ShardedCosineClassifier",
    "HardNegativeIndex",
    "KernelSettings",
    "SmoothingForm",
    "all_shards",
    "gaussian_rows",
    "sharded_cosine_ce",
]
