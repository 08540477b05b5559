"""The fused kernels' autotune key under PIC, whose sampled rows per rank change every step: every
step on every rank maps to one key (a new key re-tunes for seconds on the rank that meets it while
the others wait in the next collective), and the fused path hands that key to all three kernels."""

from __future__ import annotations

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.classifier.kernel.chunked import sharded_cosine_ce
from trainer.classifier.kernel.fused import autotune_rows_key
from trainer.classifier.sharding import ClassShard
from trainer.dry_run.backward import backward
from trainer.objectives.pic.objective import PicConfig, kernel_settings
from trainer.objectives.pic.recent_ids import RecentIds, sorted_union

N, RANKS, GLOBAL_BATCH, QUEUE = 40_000, 8, 512, 4096


def _pic_rows_per_rank(steps: int) -> list[list[int]]:
    """Per step, the rows each rank scores in a fresh PIC run: the sampled ids (the queue, filling
    over the first steps, and the batch) that fall in each rank's shard."""
    generator = np.random.default_rng(0)
    order, recent = generator.permutation(N), RecentIds(QUEUE)
    shards = [ClassShard(N, RANKS, rank) for rank in range(RANKS)]
    counts = []
    for step in range(steps):
        batch = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        sampled = sorted_union(recent.ids(), batch)
        counts.append([int(np.sum((sampled >= s.class_start) & (sampled < s.class_end))) for s in shards])
        recent.push(batch)
    return counts


def test_every_step_of_a_pic_run_maps_to_one_key_on_every_rank():
    counts = _pic_rows_per_rank(steps=20)
    seen = {count for step in counts for count in step}
    assert len({autotune_rows_key(count) for count in seen}) >= 4, "the row counts cross several powers of two"
    bound = kernel_settings(PicConfig(), N, RANKS).rows_bound
    assert bound is not None and max(seen) <= bound, "the bound is the most rows a rank can hold"
    assert {autotune_rows_key(count, bound) for count in seen} == {autotune_rows_key(bound)}


class _RowsKeys(TorchDispatchMode):
    """The ``rows_key`` each fused kernel op is called with, by op."""

    def __init__(self):
        super().__init__()
        self.keys: dict[str, set[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "instcls":
            named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
            self.keys.setdefault(func.__name__.split(".")[0], set()).add(named.get("rows_key", 0))
        return func(*args, **kwargs)


def test_the_fused_path_passes_pics_key_to_all_three_kernels():
    """On fake CUDA tensors (the fused path's ops have fake implementations): PIC's row counts of
    different steps, scored in chunks of 128 rows, reach the kernels with one key per kernel."""
    settings = kernel_settings(PicConfig(chunk_size=128, kernel="fused"), N, RANKS)
    recorder = _RowsKeys()
    with FakeTensorMode(), recorder:
        for rows in (70, 300, 1100, 2900):
            features = torch.nn.functional.normalize(torch.randn(64, 128, device="cuda"), dim=1).requires_grad_()
            weight = torch.randn(rows, 128, device="cuda", requires_grad=True)
            target_cols = torch.zeros(64, 1, dtype=torch.int64, device="cuda")
            loss = sharded_cosine_ce(features, weight, target_cols, torch.ones(64, 1, device="cuda"), settings, None)
            backward(loss.sum())
    forward_key, chunk_key = autotune_rows_key(settings.rows_bound), autotune_rows_key(128)
    assert recorder.keys == {"cosine_sum_exp": {forward_key}, "cosine_grad_features": {forward_key},
                             "cosine_grad_rows": {chunk_key}}
