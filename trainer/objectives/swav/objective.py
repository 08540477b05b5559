"""``swav``: swapped prediction of online cluster codes (SwAV, Caron et al., NeurIPS 2020), with multi-crop.

Per step, with features z_v of every view (L2-normalised) and K prototypes c_k (unit rows):

* scores ``s_v = z_v C^T``;
* codes of each global crop i (no gradient): Sinkhorn-Knopp over the whole data-parallel batch
  (``trainer.objectives.swav.sinkhorn``), with the queue's older features in front when it is full;
* loss: for each global crop i and every other view v, ``-sum_k q_i,k log softmax(s_v / tau)_k``,
  averaged over the pairs and the valid samples of the global batch.

The prototypes are a replicated ``K x D`` matrix kept *outside* ZeRO, so under ZeRO-3 too the
per-step normalisation acts on the whole matrix with no gather; their gradient is averaged over
all ranks as DDP would, and their SGD follows the shared schedule.  For the first
``freeze_prototypes_steps`` steps their gradient is dropped (they do not move at all).

Queue: ``queue_length`` global-crop features over all ranks (each rank keeps its share, newest
first), filled from ``queue_start_epoch`` (padded steps are not queued); once full it is scored
with the current prototypes and prepended to the Sinkhorn batch, which makes the equal-partition
constraint meaningful for small batches.  In checkpoints it is row-sharded over ranks, so a
reshard keeps a full queue's contents (a partly filled one starts again).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from data_pipeline.contract import ViewLayout
from trainer.checks import raise_first_invalid
from trainer.objectives.base import (
    LossOut,
    Objective,
    ObjectiveConfig,
    ObjectiveContext,
    ShardedRows,
    StepViews,
    average_gradients,
)
from trainer.objectives.memory_plan import Prototypes
from trainer.objectives.swav.sinkhorn import distributed_sinkhorn
from trainer.optim import build_optimizer
from trainer.parallel.collectives import CommTimer, all_reduce_

SINKHORN_DTYPES = ("float32", "float64")
COLLAPSE_TOLERANCE = 0.01  # |loss - ln K| / ln K under this counts as sitting at ln K


@dataclass(frozen=True)
class SwavConfig(ObjectiveConfig):
    """Attributes:
    name: "swav".
    num_prototypes: K prototype vectors (paper: 3000 for ImageNet).
    temperature: tau of the swapped-prediction softmax (paper: 0.1).
    epsilon: Sinkhorn entropy weight (paper: 0.05).
    sinkhorn_iterations: alternating normalisations (paper: 3).
    sinkhorn_dtype: "float32" or "float64"; never the engine's half precision.
    freeze_prototypes_steps: steps whose prototype gradient is dropped (paper: 313, one epoch at
        batch 4096).
    queue_length: features kept over all ranks (a multiple of the world size; 0: no queue;
        paper: 3840 for small batches).
    queue_start_epoch: first epoch that fills the queue (paper: 15).
    collapse_log_steps: log steps in a row with the loss within 1% of ln K before a warning.
    """

    name: str = "swav"
    num_prototypes: int = 3000
    temperature: float = 0.1
    epsilon: float = 0.05
    sinkhorn_iterations: int = 3
    sinkhorn_dtype: str = "float32"
    freeze_prototypes_steps: int = 313
    queue_length: int = 0
    queue_start_epoch: int = 15
    collapse_log_steps: int = 10

    def sizes_split_over_ranks(self) -> dict[str, int]:
        return {"objective.queue_length": self.queue_length} if self.queue_length else {}

    def fingerprint_fields(self) -> tuple[str, ...]:
        return ("name", "num_prototypes", "queue_length")

    def memory_plan(self, views: ViewLayout) -> Prototypes:
        return Prototypes(num_prototypes=self.num_prototypes, queue_length=self.queue_length,
                          global_views=views.global_views, sinkhorn_dtype=self.sinkhorn_dtype)

    def __post_init__(self) -> None:
        checks = [
            (self.num_prototypes >= 2, "num_prototypes", "use at least 2 prototypes (paper: 3000)"),
            (self.temperature > 0, "temperature", "use a positive temperature (paper: 0.1)"),
            (self.epsilon > 0, "epsilon", "use a positive epsilon (paper: 0.05)"),
            (self.sinkhorn_iterations >= 1, "sinkhorn_iterations", "use at least 1 iteration (paper: 3)"),
            (self.sinkhorn_dtype in SINKHORN_DTYPES, "sinkhorn_dtype", f"choose one of {SINKHORN_DTYPES}"),
            (self.freeze_prototypes_steps >= 0, "freeze_prototypes_steps", "use 0 or more steps (paper: 313)"),
            (self.queue_length >= 0, "queue_length", "use 0 (no queue) or a number of features (paper: 3840)"),
            (self.queue_start_epoch >= 0, "queue_start_epoch", "use an epoch >= 0 (paper: 15)"),
            (self.collapse_log_steps >= 1, "collapse_log_steps", "use at least 1"),
        ]
        raise_first_invalid(self, checks)


class SwavObjective(Objective):
    config: SwavConfig

    def __init__(self, config: SwavConfig, context: ObjectiveContext) -> None:
        super().__init__(config, context)
        dims = context.dims
        if config.queue_length % dims.world_size:
            raise ValueError(f"queue_length={config.queue_length} is invalid: use a multiple of the {dims.world_size} "
                             "ranks (each keeps an equal share)")
        generator = torch.Generator().manual_seed(context.seed)
        prototypes = torch.randn(config.num_prototypes, context.feature_dim, generator=generator)
        self.prototypes = torch.nn.Parameter(F.normalize(prototypes, dim=1).to(dims.device))
        self.optimizer = self._prototype_optimizer(context.optim)
        self.queue: torch.Tensor | None = None  # [queue_length / world, global crops, D], newest first
        self.queued = 0  # features pushed over all ranks (host count, the same everywhere): full at queue_length
        self.comm_timer = CommTimer()
        self._step = 0
        self._to_queue: torch.Tensor | None = None  # this step's global-crop features, queued after its backward
        self._prototypes_before_step: torch.Tensor | None = None  # under skip_step: before this step's normalising
        self._sinkhorn_seconds, self._sinkhorn_steps = 0.0, 0
        self._usage = self._entropy = None
        self._losses_near_ln_k = 0
        self._collapse_warned = False

    def _prototype_optimizer(self, optim) -> torch.optim.Optimizer:
        """SwAV's code steps the prototypes with the model's optimizer (LARC over all parameters):
        the backbone's, when the job names one, else SGD."""
        if optim.backbone_optimizer is None:
            return torch.optim.SGD([self.prototypes], lr=0.0, momentum=optim.momentum, weight_decay=optim.weight_decay)
        holder = torch.nn.Module()
        holder.register_parameter("prototypes", self.prototypes)
        return build_optimizer(optim.backbone_optimizer, holder, lr=0.0)

    # -- the seam --------------------------------------------------------------------------------

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def backbone_lr_optimizers(self) -> list[torch.optim.Optimizer]:
        return [] if self.context.optim.backbone_optimizer is None else [self.optimizer]

    def on_epoch_start(self, epoch: int) -> None:
        share = self.config.queue_length // self.context.dims.world_size
        if share and epoch >= self.config.queue_start_epoch and self.queue is None:
            self.queue = torch.zeros(share, 0, self.context.feature_dim, device=self.context.dims.device)

    def loss(self, step: StepViews) -> LossOut:
        config, dims = self.config, self.context.dims
        self._step = step.step
        normalizing = step.step >= config.freeze_prototypes_steps
        # A dropped step (skip_step) puts back what its normalising changed.
        self._prototypes_before_step = self.prototypes.detach().clone() if (
            normalizing and self.context.optim.skips_nonfinite_steps) else None
        if normalizing:
            # SwAV normalises them before every step, outside autograd (frozen ones are still unit
            # rows from the initialisation: re-normalising would only flip last bits).
            with torch.no_grad():
                self.prototypes.copy_(F.normalize(self.prototypes, dim=1))
        features = [F.normalize(view.features.float(), dim=1) for view in step.views]
        scores = [z @ self.prototypes.t() for z in features]
        code_views = [i for i, view in enumerate(step.views) if view.kind == "global"]
        if len(step.views) < 2 or not code_views:
            raise ValueError("swav needs at least two views, one of them global (data.loader.augment.num_views >= 1 "
                             "and num_views + small_crops >= 2)")
        valid = step.valid.float()
        global_valid = int(step.global_valid) if step.global_valid is not None else None

        started = time.perf_counter()
        codes = {i: self._codes(i, scores[i], features[i], step.valid, global_valid, code_views) for i in code_views}
        self._sinkhorn_seconds += time.perf_counter() - started
        self._sinkhorn_steps += 1
        # A padded step (an epoch's last) is not queued: its repeats would later count as samples.
        # Queued after the backward, so that a dropped step (skip_step) leaves the queue as it was.
        if self.queue is not None and (global_valid is None or global_valid == step.valid.shape[0] * dims.world_size):
            self._to_queue = torch.stack([features[i].detach() for i in code_views], dim=1)  # [b, crops, D]

        per_sample = torch.zeros_like(valid)
        for i in code_views:
            others = [v for v in range(len(step.views)) if v != i]
            for v in others:
                per_sample = per_sample - (codes[i] * F.log_softmax(scores[v] / config.temperature, dim=1)).sum(dim=1) \
                    / len(others)
        per_sample = per_sample / len(code_views)
        # Gradients are averaged over the ranks: each rank's share of the global valid mean.
        denominator = (global_valid / dims.world_size) if global_valid else valid.sum().clamp_min(1.0)
        loss = (per_sample * valid).sum() / denominator
        if step.validate:  # a log step: the global loss is logged, not this rank's share
            return LossOut(loss, reported=self._observe(loss, codes[code_views[0]], step.valid))
        return LossOut(loss)

    def _codes(self, view: int, scores, features, valid, global_valid, code_views) -> torch.Tensor:
        """Sinkhorn codes of this view's samples, with the queue's features in front when full."""
        config, dims = self.config, self.context.dims
        scores = scores.detach()
        queued = self._full_queue_features(code_views.index(view))
        if queued is not None:
            scores = torch.cat([queued @ self.prototypes.detach().t(), scores])
            valid = torch.cat([torch.ones(queued.shape[0], dtype=torch.bool, device=valid.device), valid])
            if global_valid is not None:
                global_valid += self.config.queue_length
        codes = distributed_sinkhorn(scores, config.epsilon, config.sinkhorn_iterations, dims.data_parallel_group,
                                     valid, global_valid, getattr(torch, config.sinkhorn_dtype), self.comm_timer)
        return codes[-features.shape[0]:].float()

    def _full_queue_features(self, slot: int) -> torch.Tensor | None:
        """The queue's features of global crop ``slot`` once every entry holds one, else None.
        Decided from the host count, so every rank agrees and nothing syncs with the device."""
        if self.queue is None or self.queued < self.config.queue_length:
            return None
        return self.queue[:, slot]

    @torch.no_grad()
    def _push_queue(self, latest: torch.Tensor) -> None:
        if self.queue.shape[1] != latest.shape[1]:  # first push (or another number of global crops)
            self.queue = torch.zeros(self.queue.shape[0], latest.shape[1], latest.shape[2], device=latest.device)
        keep = self.queue.shape[0] - latest.shape[0]
        self.queue = torch.cat([latest[: self.queue.shape[0]], self.queue[:max(keep, 0)]])
        self.queued = min(self.config.queue_length, self.queued + latest.shape[0] * self.context.dims.world_size)

    def after_backward(self) -> None:
        if self._to_queue is not None:
            self._push_queue(self._to_queue)
            self._to_queue = None
        if self._step < self.config.freeze_prototypes_steps:
            self.prototypes.grad = None  # frozen: SGD skips a parameter without gradient entirely
        else:
            average_gradients([self.prototypes], self.context.dims)

    def skip_step(self) -> None:
        self._to_queue = None
        if self._prototypes_before_step is not None:
            with torch.no_grad():
                self.prototypes.copy_(self._prototypes_before_step)

    # -- observability ---------------------------------------------------------------------------

    @torch.no_grad()
    def _observe(self, loss: torch.Tensor, codes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """On log steps (a host sync is allowed there): code statistics and the collapse watch.
        Returns the step's loss over all ranks."""
        dims = self.context.dims
        used = torch.zeros(codes.shape[1], device=codes.device)
        used[codes[valid].argmax(dim=1)] = 1.0
        entropy = -(codes * torch.log(codes.clamp_min(1e-12))).sum(dim=1)
        # Each rank's loss is its share of the global mean times the world size: the mean of the
        # shares is the global loss (a padded last batch would skew one rank's value).
        totals = torch.stack([(entropy * valid).sum(), valid.sum().float(), loss.detach().float() / dims.world_size])
        stats = torch.cat([used, totals])
        all_reduce_(stats, torch.distributed.ReduceOp.SUM, dims.data_parallel_group, self.comm_timer)
        self._usage = float((stats[:-3] > 0).float().mean())
        self._entropy = float(stats[-3] / stats[-2].clamp_min(1.0))
        ln_k = math.log(self.config.num_prototypes)
        near = abs(float(stats[-1]) - ln_k) < COLLAPSE_TOLERANCE * ln_k
        self._losses_near_ln_k = self._losses_near_ln_k + 1 if near else 0
        if self._losses_near_ln_k >= self.config.collapse_log_steps and not self._collapse_warned:
            self._collapse_warned = True
            if dims.rank == 0:
                print(f"[instcls] WARNING: the swav loss has stayed at ln K = {ln_k:.3f} for "
                      f"{self._losses_near_ln_k} log steps: the codes are uniform and the network is probably "
                      "collapsing. Check that features and prototypes are normalised, keep num_prototypes above the "
                      "feature dimension, lower the learning rate, use a queue (objective.queue_length) for "
                      f"small batches, or lower objective.epsilon (now {self.config.epsilon}) for sharper codes.",
                      file=sys.stderr)
        return stats[-1]

    def metrics(self) -> dict[str, float]:
        metrics = {"comm_seconds": self.comm_timer.drain(),
                   "collapse_suspected": float(self._losses_near_ln_k >= self.config.collapse_log_steps)}
        if self._sinkhorn_steps:  # mean per step since the last call
            metrics["sinkhorn_seconds"] = round(self._sinkhorn_seconds / self._sinkhorn_steps, 5)
        if self._usage is not None:
            metrics["prototype_usage"] = round(self._usage, 4)
            metrics["code_entropy"] = round(self._entropy, 4)
        self._sinkhorn_seconds, self._sinkhorn_steps = 0.0, 0
        return metrics

    # -- checkpoints -----------------------------------------------------------------------------

    def _queue_rows(self) -> ShardedRows:
        dims, share = self.context.dims, self.config.queue_length // self.context.dims.world_size
        return ShardedRows(self.queue, dims.rank * share, (dims.rank + 1) * share, self.config.queue_length)

    def state_dict(self) -> dict:
        optimizer_state = self.optimizer.state.get(self.prototypes, {})
        momentum = optimizer_state.get("momentum_buffer")
        return {"prototypes": self.prototypes.detach(),
                "momentum": momentum if momentum is not None else torch.zeros(0),
                # every key of the prototypes' optimizer (AdamW's moments and step counter too)
                "optimizer_state": {k: torch.as_tensor(v) for k, v in optimizer_state.items() if v is not None},
                "queue": self._queue_rows(), "queued": self.queued, "world_size": self.context.dims.world_size}

    def load_state_dict(self, state: dict) -> None:
        device = self.context.dims.device
        with torch.no_grad():
            self.prototypes.copy_(state["prototypes"])
        saved = state.get("optimizer_state") or (
            {"momentum_buffer": state["momentum"]} if state["momentum"].numel() else {})
        if saved:
            current = self.optimizer.state[self.prototypes]
            initial_state = getattr(self.optimizer, "initial_state", None)
            if initial_state is not None and not current:  # where the optimizer keeps each key (device, dtype)
                current.update(initial_state(self.prototypes, self.optimizer.param_groups[0]))
            for key, value in saved.items():
                if torch.is_tensor(current.get(key)):
                    current[key].copy_(value)
                else:
                    current[key] = value.to(device).clone()
        rows = state["queue"].rows
        self.queue = None if rows is None else rows.to(device).clone()
        self.queued = state["queued"]
        if self.queue is not None and state["world_size"] != self.context.dims.world_size and \
                self.queued < self.config.queue_length:
            # Re-split rows of partly filled per-rank queues would interleave empty entries with
            # features; a full queue re-splits exactly, a partial one starts again.
            self.queue.zero_()
            self.queued = 0
