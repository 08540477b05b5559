"""The contrastive prior: W starts as the features of the random network.

One pass over the data with no gradients and BatchNorm in train mode (its running statistics
update, as in the paper); each sample's L2-normalised head feature is written into the row of its
instance.  The owner of a row can be any rank, so features and ids are gathered over all ranks and
every rank keeps the rows it owns.  Padding repeats write the same row twice with the same image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.classifier import ShardedCosineClassifier
from trainer.parallel import ParallelDims
from trainer.parallel.collectives import gather_rows


@torch.no_grad()
def contrastive_prior(engine, loader, classifier: ShardedCosineClassifier, dims: ParallelDims, dtype: torch.dtype) -> int:
    """Fill the classifier shard from one pass of ``loader``; returns the rows written here."""
    engine.train()  # BatchNorm uses batch statistics and updates its running averages
    written = torch.zeros(classifier.num_classes_local, dtype=torch.bool, device=classifier.weight.device)
    for batch in loader:
        features = F.normalize(engine(batch.views[0].to(dtype)).float(), dim=1)
        features = gather_rows(features, dims.data_parallel_group)
        ids = gather_rows(batch.instance_ids, dims.data_parallel_group)
        owned = classifier.shard.is_local(ids)
        rows = ids[owned] - classifier.class_start
        classifier.weight.data[rows] = features[owned]
        written[rows] = True
    missing = int((~written).sum())
    if missing:
        raise RuntimeError(f"contrastive prior saw no sample for {missing} of this rank's classes; the loader "
                           "must cover every instance (last_batch='pad')")
    return int(written.sum())
