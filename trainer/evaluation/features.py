"""Backbone features of a labelled shard set, each rank keeping the rows of the samples it extracted.

Nothing here gathers a whole bank: at ImageNet-21K scale that is 14.2M x 2048 x 4 B per rank.
``gather_to_rank0_host`` does, into rank 0 only, for the linear probe, which needs every feature in
one process.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.contract import IndexedLoader, Sampler, build_loader, sample_table
from trainer.evaluation.bank_subset import SubsetSampler, bank_subset_ids
from trainer.models.backbone import InstanceModel
from trainer.parallel import ParallelDims
from trainer.parallel.collectives import gather_rows, gather_uneven_rows_to_rank0, group_size

BANK_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class LocalFeatures:
    """The samples this rank extracted, each once (padding repeats left out), ids ascending:
    ``features [n, F]`` in the dtype asked for, ``labels`` and ``ids`` ``[n]`` int64, all on the rank's device."""

    features: torch.Tensor
    labels: torch.Tensor
    ids: torch.Tensor


@torch.no_grad()
def extract_local_features(model: InstanceModel, loader: IndexedLoader,
                           dtype: torch.dtype = torch.float32) -> LocalFeatures:
    """This rank's share of ``loader``'s samples (an inference loader: resize + centre crop, the
    whole shard set or its sampler's ids), BatchNorm in eval mode.

    Rows are written into one buffer sized for this rank's steps (about N/T + one batch), not
    concatenated at the end, so the peak is the shard itself, not twice it.
    """
    model.eval()
    device = loader.device
    capacity = len(loader) * loader.config.batch_size
    features = None
    labels = torch.empty(capacity, dtype=torch.int64, device=device)
    ids = torch.empty(capacity, dtype=torch.int64, device=device)
    filled = 0
    for batch in loader.epoch_batches(0):
        rows = model.backbone_features(batch.views[0])
        if features is None:
            features = torch.empty((capacity, rows.shape[1]), dtype=dtype, device=device)
        valid = batch.valid.nonzero().squeeze(1)
        end = filled + valid.numel()
        features[filled:end] = rows[valid]
        labels[filled:end] = batch.labels[valid]
        ids[filled:end] = batch.instance_ids[valid]
        filled = end
    return LocalFeatures(features[:filled], labels[:filled], ids[:filled])


def bank_sampler(shard_dir: Path, eval_section, dims: ParallelDims, batch_size: int) -> Sampler | None:
    """The sampler of ``eval.bank_samples``'s fixed subset, or None for the whole shard set."""
    if eval_section.bank_samples is None:
        return None
    ids = bank_subset_ids(sample_table(shard_dir).num_samples, eval_section.bank_samples,
                          eval_section.bank_subset_seed)
    return SubsetSampler(ids, dims.world_size, batch_size)


class EvaluationData:
    """The two inference loaders of frozen-feature evaluation of ``data`` (a ``DataSection``), built
    once and kept, so every evaluation of a run reuses their decoders (a DALI pipeline each): the
    bank is ``knn_bank_shards`` (default: the training shards; only ``eval.bank_samples`` of them
    when set), stored in ``eval.bank_dtype``; the queries are the held-out ``eval_shards``, in float32."""

    def __init__(self, data, eval_section, dims: ParallelDims) -> None:
        bank_dir = data.knn_bank_shards or data.train_shards
        sampler = bank_sampler(bank_dir, eval_section, dims, data.loader.batch_size)
        self.bank = build_loader(bank_dir, data.loader, dims.rank, dims.world_size, dims.device, train=False,
                                 sampler=sampler)
        self.queries = build_loader(data.eval_shards, data.loader, dims.rank, dims.world_size, dims.device,
                                    train=False)
        self.bank_dtype = BANK_DTYPES[eval_section.bank_dtype]

    def bank_and_queries(self, model: InstanceModel) -> tuple[LocalFeatures, LocalFeatures]:
        """``(bank, queries)``: this rank's rows of each, through ``model``."""
        return extract_local_features(model, self.bank, self.bank_dtype), extract_local_features(model, self.queries)


def gather_to_rank0_host(local: LocalFeatures, dims: ParallelDims, block_rows: int = 8192) -> LocalFeatures | None:
    """Collective: every rank's rows, sorted by id, in rank 0's host memory (features in float32);
    None on the other ranks, which hold nothing more than their own rows (at ImageNet-21K a whole
    fp32 bank is ~116 GB: once per job, not once per rank).  Moved through the device
    ``block_rows`` rows at a time, each block written to its place."""
    group = dims.data_parallel_group
    counts = gather_rows(torch.tensor([len(local.ids)], device=local.ids.device), group).tolist()
    all_ids = gather_uneven_rows_to_rank0(local.ids, group, counts)
    receiving = all_ids is not None
    if receiving:
        sorted_ids = all_ids.cpu().sort().values
        features = torch.empty((len(sorted_ids), local.features.shape[1]), dtype=torch.float32)
        labels = torch.empty(len(sorted_ids), dtype=torch.int64)
    for start in range(0, max(counts), block_rows):  # the same number of rounds on every rank
        block = slice(start, start + block_rows)
        block_counts = [max(0, min(count - start, block_rows)) for count in counts]
        ids = gather_uneven_rows_to_rank0(local.ids[block], group, block_counts)
        rows = gather_uneven_rows_to_rank0(local.features[block], group, block_counts)
        row_labels = gather_uneven_rows_to_rank0(local.labels[block], group, block_counts)
        if receiving:
            places = torch.searchsorted(sorted_ids, ids.cpu())
            features[places] = rows.cpu().float()
            labels[places] = row_labels.cpu()
    return LocalFeatures(features, labels, sorted_ids) if receiving else None


def features_digest(local: LocalFeatures, group) -> str:
    """Collective: a fingerprint of every rank's rows together, the same for any number of ranks and
    any split of the rows: each row's (id, label, feature bytes) is hashed to 64 bits and the
    hashes are added modulo 2^64 over all rows of all ranks.  Equal digests mean bit-identical
    features (up to a 2^-64 chance): the check that two runs scored the same network, without
    moving any feature between ranks.  One host copy of this rank's rows."""
    features = local.features.detach().cpu().contiguous()
    # the row width named, not -1: a rank may hold no held-out rows (fewer eval shards than ranks)
    width = math.prod(features.shape[1:]) * features.element_size()
    row_bytes = features.view(torch.uint8).reshape(features.shape[0], width).numpy()
    ids, labels = local.ids.cpu().numpy(), local.labels.cpu().numpy()
    low = high = 0
    for row, sample_id, label in zip(row_bytes, ids, labels):
        key = np.array([sample_id, label], dtype=np.int64).tobytes() + row.tobytes()
        value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        low, high = low + (value & 0xFFFFFFFF), high + (value >> 32)
    # the two 32-bit halves are summed apart, so int64 all-reduces never overflow
    combined = torch.tensor([low, high], dtype=torch.int64, device=local.ids.device)
    if group_size(group) > 1:
        dist.all_reduce(combined, group=group)
    low, high = (int(v) for v in combined.tolist())
    return f"{(low + (high << 32)) % 2**64:016x}"


def save_features(path: Path, bank: LocalFeatures, queries: LocalFeatures) -> None:
    """Rank 0, with the sets ``gather_to_rank0_host`` gathered: the bank's and the queries' features,
    labels and ids (sorted by id) written to ``path`` (``torch.save``, atomically; loads with
    ``weights_only=True``).  Meant for held-out sets and ``eval.bank_samples`` subsets, not a whole
    ImageNet bank."""
    saved = {name: {"ids": rows.ids, "labels": rows.labels, "features": rows.features}
             for name, rows in (("bank", bank), ("queries", queries))}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    torch.save(saved, temporary)
    temporary.replace(path)
