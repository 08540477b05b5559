"""The N-way instance classifier: class sharding, distributed chunked softmax CE, the module."""

from trainer.classifier.config import ClassifierConfig
from trainer.classifier.module import ShardedCosineClassifier, gaussian_rows
from trainer.classifier.sharding import ClassShard, all_shards
from trainer.classifier.softmax_ce import ShardedCosineSoftmaxCE, SmoothingForm
from trainer.classifier.validation import ClassifierInputError

__all__ = [
    "ClassShard",
    "ClassifierConfig",
    "ClassifierInputError",
    "ShardedCosineClassifier",
    "ShardedCosineSoftmaxCE",
    "SmoothingForm",
    "all_shards",
    "gaussian_rows",
]
