"""``pic``: Parametric Instance Classification (seeds 001/002) with its cost independent of N.

The same N-way cosine classifier as ``instance`` (sharded by class range over the classifier group,
features all-gathered), with two changes:

* recent negative sampling: a step's softmax runs over the instances of its global batch plus the
  K ids seen most recently (``RecentIds``, the same on every rank), not all N rows.  Each rank
  scores the sampled rows it owns with the chunked kernel, so a step costs O(B (K + B) / T),
  whatever N is.  ``negatives: all`` scores every row instead (the full softmax, for ablations);
* the classifier rows live in a ``RowStore`` (device, host or disk) and are trained by
  ``LazyRowSGD``: the rows a step samples are fetched, brought forward over the steps they
  skipped (exact under any learning-rate schedule), updated, and written back.

The sliding-window data order (PIC's Algorithm 3) is the data sampler's job
(``data.loader.sampler.kind: sliding_window``); the two are independent switches.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from data_pipeline.contract import StepIndices, ViewLayout, to_device
from trainer.classifier.classifier_config import HeadSettings
from trainer.classifier.head import CosineHead
from trainer.classifier.kernel.chunked import KernelSettings
from trainer.classifier.sharded_classifier import gaussian_rows
from trainer.classifier.sharding import ClassShard
from trainer.objectives.base import LossOut, Objective, ObjectiveConfig, ObjectiveContext, ShardedRows, StepViews
from trainer.objectives.memory_plan import SampledRows
from trainer.objectives.pic.lazy_sgd import LazyRowSGD
from trainer.objectives.pic.recent_ids import RecentIds, sorted_union
from trainer.objectives.pic.row_store import STORE_KINDS, make_row_store
from trainer.objectives.pic.working_set import WorkingSet
from trainer.parallel.collectives import CommTimer, all_reduce_
from trainer.parallel.device_threads import device_thread_pool

NEGATIVES = ("recent", "all")
ROW_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class PicConfig(HeadSettings, ObjectiveConfig):
    """The head's fields are ``HeadSettings``' (temperature, paper: 0.2; chunk_size: sampled rows
    scored at once; init_std; co2_alpha and co2_temperature: CO2's term over the sampled rows).
    Attributes of the method:
    name: "pic".
    negatives: "recent" (the batch plus the ``queue_size`` most recent ids) or "all" (every row
        each step: the full softmax, O(N) per step, for ablations).
    queue_size: K, recent ids kept as negatives (paper: 65536).
    row_store: where W and its momentum live: "device", "host" (pinned on GPUs) or "disk"
        (memory-mapped files in ``row_store_dir``; see ``trainer.objectives.pic.row_store``).
    row_store_dir: local directory of a disk store (one sub-directory per rank).
    row_dtype: "float32", or "float64" for rows that accumulate no rounding over very long runs
        (twice the store).
    prefetch: fetch the next step's rows in the background while the current step finishes
        (a thread; a side stream on GPUs).
    """

    name: str = "pic"
    temperature: float = 0.2
    USUAL_TEMPERATURE: ClassVar[str] = "paper: 0.2"
    negatives: str = "recent"
    queue_size: int = 65536
    row_store: str = "device"
    row_store_dir: str | None = None
    row_dtype: str = "float32"
    prefetch: bool = True

    def checks(self) -> list[tuple[bool, str, str]]:
        return [
            *super().checks(),
            (self.negatives in NEGATIVES, "negatives", f"choose one of {NEGATIVES}"),
            (self.queue_size >= 0, "queue_size", "use K >= 0 recent ids (paper: 65536)"),
            (self.row_store in STORE_KINDS, "row_store", f"choose one of {STORE_KINDS}"),
            (self.row_store != "disk" or bool(self.row_store_dir), "row_store_dir",
             "a disk row store needs a directory on a local disk (e.g. /scratch/instcls-rows)"),
            (self.row_dtype in ROW_DTYPES, "row_dtype", f"choose one of {ROW_DTYPES}"),
        ]

    def memory_plan(self, views: ViewLayout) -> SampledRows:
        return SampledRows(queue_size=self.queue_size, row_store=self.row_store, chunk_size=self.chunk_size,
                           kernel=self.kernel, co2=self.term(views) is not None, all_negatives=self.negatives == "all")


def kernel_settings(config: PicConfig, num_instances: int, classifier_ranks: int) -> KernelSettings:
    """The head's kernel settings: the sampled rows a rank scores change every step, and are never
    more than the largest shard of the ``num_instances`` rows over ``classifier_ranks``."""
    return replace(config.kernel_settings(), rows_vary=True, rows_bound=-(-num_instances // classifier_ranks))


@dataclass
class _Prefetch:
    """The next step's new store rows, being read in the background."""

    step: int
    batch: StepIndices  # the sampler's batch it was planned for
    sampled: np.ndarray | None
    future: Future

    def serves(self, step: StepViews) -> bool:
        batch = step.plan
        return self.step == step.step and np.array_equal(self.batch.ids, batch.ids) and \
            np.array_equal(self.batch.valid, batch.valid)


class PicObjective(Objective):
    config: PicConfig

    def __init__(self, config: PicConfig, context: ObjectiveContext) -> None:
        super().__init__(config, context)
        dims, n = context.dims, context.num_instances
        self.shard = ClassShard(n, dims.classifier_parallel_size, dims.classifier_rank)
        self.group, self.replica_group = dims.classifier_group, dims.classifier_replica_group
        directory = None if config.row_store_dir is None else Path(config.row_store_dir) / f"rank-{dims.rank:05d}"
        self.store = make_row_store(config.row_store, self.shard.num_classes_local, context.feature_dim,
                                    getattr(torch, config.row_dtype), dims.device, directory)
        start = self.shard.class_start
        self.store.fill(
            lambda a, b: gaussian_rows(start + a, b - a, context.feature_dim, config.init_std, context.seed), None, 0
        )
        self.optimizer = LazyRowSGD(context.optim.momentum, context.optim.weight_decay)
        self.optimizer.after_step = self._after_step
        self.working = WorkingSet(self.store, self.optimizer)
        self.recent = RecentIds(config.queue_size)
        self.comm_timer = CommTimer()
        # Backbone gradients are averaged over all ranks; a rank's features feed the whole group.
        self.head = CosineHead(
            kernel_settings(config, n, dims.classifier_parallel_size),
            self.group,
            dims.classifier_parallel_size,
            config.term(context.views),
            self.comm_timer,
        )
        self.next_step = 0  # the next step to run; a checkpoint brings every row to it
        self._next_batch = None  # the sampler's next global batch, for the prefetch
        self._prefetch: _Prefetch | None = None
        self._pool = device_thread_pool(dims.device, "pic-prefetch") if config.prefetch else None
        self._side_stream = torch.cuda.Stream(dims.device) if config.prefetch and dims.device.type == "cuda" else None
        self._sampled_rows = 0
        self._fetch_seconds = 0.0
        self._pushed_ids = np.zeros(0, dtype=np.int64)

    # -- which rows a step scores ----------------------------------------------------------------

    def _sampled_ids(self, batch) -> np.ndarray | None:
        """Sorted distinct global ids the step's softmax runs over (None: all rows): the recent ids
        and the batch's valid ids (padding repeats are neither targets nor negatives)."""
        if self.config.negatives == "all":
            return None
        return sorted_union(self.recent.ids(), batch.ids[batch.valid])

    def _local_rows(self, sampled: np.ndarray | None) -> np.ndarray:
        """Sorted local row indices of the sampled ids this rank owns."""
        start, end = self.shard.class_start, self.shard.class_end
        if sampled is None:
            return np.arange(end - start, dtype=np.int64)
        return sampled[np.searchsorted(sampled, start) : np.searchsorted(sampled, end)] - start

    def _read_new(self, rows: np.ndarray, step: int, written=None):
        """The prefetch: store rows the next step needs and the working set lacks.  ``written``: a
        CUDA event after the main stream's last writes to the store, which the side stream waits for."""
        if self._side_stream is None:
            return self.working.read_store(rows, step)
        # Copies overlap the main stream's work; the explicit device keeps the stream restore on this GPU.
        with torch.cuda.device(self._side_stream.device), torch.cuda.stream(self._side_stream):
            self._side_stream.wait_event(written)
            fetched = self.working.read_store(rows, step)
        self._side_stream.synchronize()
        return fetched

    def _rows_for(self, step: StepViews) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """``(local rows, W rows, momentum rows)`` of the step's sampled set, current at this step."""
        start = time.perf_counter()
        prefetch, self._prefetch = self._prefetch, None
        new = None if prefetch is None else prefetch.future.result()
        if prefetch is not None and prefetch.serves(step):
            # The queue has not changed since the prefetch: its sampled set is this step's.
            sampled = prefetch.sampled
            if self._side_stream is not None:
                for tensor in new[:2]:
                    tensor.record_stream(torch.cuda.current_stream(self.context.dims.device))
        else:
            sampled, new = self._sampled_ids(step.plan), None
        rows = self._local_rows(sampled)
        weight, momentum = self.working.gather(rows, step.step, new)
        self._fetch_seconds += time.perf_counter() - start
        return rows, weight, momentum

    def _after_step(self, step: int, updated: bool = True) -> None:
        """After the update of ``step``: remember its ids (not those of a dropped step, whose rows
        did not learn them), start reading the next step's new rows."""
        self.working.stepped(step)
        if updated:
            self.recent.push(self._pushed_ids)
        self.next_step = step + 1
        if self._pool is not None and self._next_batch is not None:
            sampled = self._sampled_ids(self._next_batch)
            missing = self.working.new_rows(self._local_rows(sampled))
            written = None
            if self._side_stream is not None:
                written = torch.cuda.Event()
                written.record(torch.cuda.current_stream(self.context.dims.device))
            future = self._pool.submit(self._read_new, missing, step + 1, written)
            self._prefetch = _Prefetch(step + 1, self._next_batch, sampled, future)

    def _drop_prefetch(self) -> None:
        """Wait for and discard a prefetch (before anything else reads or writes the store)."""
        if self._prefetch is not None:
            self._prefetch.future.result()
            self._prefetch = None

    # -- the seam --------------------------------------------------------------------------------

    def optimizers(self) -> list:
        return [self.optimizer]

    def loss(self, step: StepViews) -> LossOut:
        if step.plan is None:
            raise ValueError("the pic objective needs StepViews.plan (the sampler's ids of every rank)")
        dims = self.context.dims
        rows, weight, momentum = self._rows_for(step)
        self._sampled_rows = rows.size
        self._next_batch = step.next_plan
        # Only valid ids enter the queue: padding repeats were seen earlier in the epoch.
        self._pushed_ids = step.plan.ids[step.plan.valid]

        # The classifier group's batch, in all-gather order.
        layout, size = self.context.views, dims.classifier_parallel_size
        first = (dims.rank // size) * size
        group_ids = layout.group_columns(step.plan.ids, first, size)
        group_valid = layout.group_columns(step.plan.valid, first, size)
        if group_ids.size and (group_ids.min() < 0 or group_ids.max() >= self.shard.num_classes):
            # Host ids from the sampler, the same on every rank: all ranks raise together.
            raise ValueError(
                f"step {step.step}: the sampler gave instance ids outside [0, {self.shard.num_classes}); "
                "the shard manifest's num_instances does not match the ids stored in the shards"
            )
        owned = (group_ids >= self.shard.class_start) & (group_ids < self.shard.class_end) & group_valid
        target_cols = np.where(owned, np.searchsorted(rows, group_ids - self.shard.class_start), -1)
        device = dims.device
        # From pinned memory: a pageable source would make these copies wait for the GPU.
        target_cols = to_device(target_cols[:, None], device)
        valid = to_device(group_valid, device)

        # For fp32 rows the leaf shares their memory: the update after backward writes them in place.
        leaf = weight.float().detach().requires_grad_(True)
        self.optimizer.set_pending(weight, momentum, leaf, step.step)
        features = self.stacked_features(step)
        ones = torch.ones(target_cols.shape[0], 1, device=device)
        loss_sum = self.head.loss_sum(features, leaf, target_cols, ones, valid, padding_may_be_infinite=True)
        replicas = dims.world_size // size
        return LossOut(loss_sum * (replicas / max(step.plan.global_valid * layout.num_views, 1)))

    def after_backward(self) -> None:
        leaf = self.optimizer.pending_leaf
        if self.replica_group is not None and leaf is not None and leaf.grad is not None:
            grad = leaf.grad  # the same rows on every replica: average their gradients
            grad.div_(self.context.dims.world_size // self.context.dims.classifier_parallel_size)
            all_reduce_(grad, torch.distributed.ReduceOp.SUM, self.replica_group, self.comm_timer)

    def skip_step(self) -> None:
        """The fetched rows were only brought forward (exact, no update), so they may stay held."""
        self._after_step(self.optimizer.skip(), updated=False)

    def metrics(self) -> dict[str, float]:
        metrics = {
            "comm_seconds": self.comm_timer.drain(),
            "sampled_rows": float(self._sampled_rows),
            "corrected_rows": float(self.working.corrected_rows),
            "row_fetch_seconds": round(self._fetch_seconds, 4),
        }
        self.working.corrected_rows, self._fetch_seconds = 0, 0.0
        return metrics

    # -- checkpoints -----------------------------------------------------------------------------

    def _rows(self, tensor: torch.Tensor) -> ShardedRows:
        dims = self.context.dims
        # A disk store's rows may not fit in memory: an asynchronous save snapshots them beside the store.
        return ShardedRows(
            tensor,
            self.shard.class_start,
            self.shard.class_end,
            self.shard.num_classes,
            primary=dims.rank < dims.classifier_parallel_size,
            scratch_dir=self.store.directory,
        )

    def state_dict(self) -> dict:
        """Every row brought to the current step first, so the saved W and momentum are exact."""
        self._drop_prefetch()
        self.working.materialize(self.next_step)
        self.store.flush()
        # One tensor [rows, 2, D] (W, momentum): a view per part would save the shared storage twice.
        return {"rows": self._rows(self.store.rows), "recent": self.recent.state_dict(), "step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self._drop_prefetch()
        step = state["step"]
        rows = state["rows"].rows
        self.store.fill(lambda a, b: rows[a:b, 0], lambda a, b: rows[a:b, 1], step)
        self.optimizer.transitions.reset(step)
        self.working.reset(step)
        self.recent.load_state_dict(state["recent"])
        self.next_step = step
