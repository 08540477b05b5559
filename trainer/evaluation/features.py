"""Backbone features of a whole labelled shard set, gathered on every rank in id order."""

from __future__ import annotations

from pathlib import Path

import torch

from data_pipeline.config import LoaderConfig
from data_pipeline.loader import build_loader
from trainer.models.backbone import InstanceModel
from trainer.parallel import ParallelDims
from trainer.parallel.collectives import gather_rows


@torch.no_grad()
def extract_features(
    model: InstanceModel, shard_dir: Path, loader_config: LoaderConfig, dims: ParallelDims
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [N, F] fp32 on CPU, labels [N])`` for every instance, rows sorted by id.

    Uses the inference pipeline (resize + centre crop) and BatchNorm in eval mode.
    """
    model.eval()
    loader = build_loader(shard_dir, loader_config, dims.rank, dims.world_size, dims.device, train=False)
    features, labels, ids = [], [], []
    for batch in loader.epoch_batches(0):
        group = dims.data_parallel_group
        valid = gather_rows(batch.valid, group).cpu()
        features.append(gather_rows(model.backbone_features(batch.views[0]).float(), group).cpu()[valid])
        labels.append(gather_rows(batch.labels, group).cpu()[valid])
        ids.append(gather_rows(batch.instance_ids, group).cpu()[valid])
    order = torch.cat(ids).argsort()
    return torch.cat(features)[order], torch.cat(labels)[order]


def bank_and_queries(model: InstanceModel, data, dims: ParallelDims):
    """``(bank, bank_labels, queries, query_labels)`` for frozen-feature evaluation of ``data`` (a
    ``DataSection``): the bank is ``knn_bank_shards`` (default: the training shards), the queries
    the held-out ``eval_shards``."""
    bank, bank_labels = extract_features(model, data.knn_bank_shards or data.train_shards, data.loader, dims)
    queries, query_labels = extract_features(model, data.eval_shards, data.loader, dims)
    return bank, bank_labels, queries, query_labels
