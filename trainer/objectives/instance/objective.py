"""``instance``: One-Million-Way's method (Liu et al., AAAI 2021) on the sharded cosine classifier.

Every image is its own class of an N-way cosine softmax (temperature 0.15) whose weight matrix is
sharded over the classifier group (DHP) or replicated (the DDP baseline).  Two techniques:

* contrastive prior: before the first step W is filled with the features of the random network
  (one no-grad pass, BatchNorm in train mode), see ``contrastive_prior``;
* top-K hardest label smoothing: once per epoch (from ``smoothing_start_epoch``) the K most
  similar other rows of each row are searched; a sample's target then puts ``1 - alpha`` on its own
  class and ``alpha / K`` on each of those.

W is trained outside ZeRO by its own SGD (or SGD applied inside the backward) on the shared
schedule; its gradient is never averaged over the data-parallel group, only over replicas of the
same shard when several classifier groups exist.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from data_pipeline.contract import ViewLayout
from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
from trainer.classifier.classifier_config import ClassifierSettings
from trainer.classifier.hard_negatives import HardNegativeIndex, search_hard_negatives
from trainer.objectives.base import LossOut, Objective, ObjectiveConfig, ObjectiveContext, ShardedRows, StepViews
from trainer.objectives.memory_plan import ClassifierRows
from trainer.parallel.collectives import gather_rows


@dataclass(frozen=True)
class InstanceConfig(ClassifierSettings, ObjectiveConfig):
    """The classifier's fields are ``ClassifierSettings``' (temperature, chunk_size, mode,
    smoothing_alpha, top_k, smoothing_form, init_std, co2_alpha, co2_temperature,
    logits_cache_bytes), with the paper's smoothing on by default.  Attributes of the method:
    name: "instance".
    contrastive_prior: initialise W from one no-grad pass of the random network (BatchNorm in
        train mode); false: Gaussian rows of std ``init_std``.
    smoothing_start_epoch: first epoch that uses smoothing (its search runs at that epoch's start).
    update_in_backward: apply W's SGD chunk by chunk inside the backward, so W's gradient never
        exists in full (W + momentum instead of W + gradient + momentum; what ``instcls plan
        --update-in-backward`` predicts).  DHP with a single classifier group only.
    """

    name: str = "instance"
    smoothing_alpha: float = 0.2
    contrastive_prior: bool = True
    smoothing_start_epoch: int = 0
    update_in_backward: bool = False

    def memory_plan(self, views: ViewLayout) -> ClassifierRows:
        return ClassifierRows(sharded=self.mode == "dhp", chunk_size=self.chunk_size,
                              logits_cache_bytes=self.logits_cache_bytes, kernel=self.kernel,
                              hard_negatives=self.top_k if self.smoothing_alpha > 0 else 0,
                              co2=self.term(views) is not None, update_in_backward=self.update_in_backward)

    def checks(self) -> list[tuple[bool, str, str]]:
        return [
            *super().checks(),
            (self.smoothing_start_epoch >= 0, "smoothing_start_epoch", "use an epoch >= 0"),
            (not self.update_in_backward or self.mode == "dhp", "update_in_backward",
             "the in-backward update needs mode 'dhp' (DDP must all-reduce W's gradient before updating)"),
        ]


class InstanceObjective(Objective):
    config: InstanceConfig

    def __init__(self, config: InstanceConfig, context: ObjectiveContext) -> None:
        super().__init__(config, context)
        classifier_config = ClassifierConfig.of(config, num_classes=context.num_instances,
                                                feature_dim=context.feature_dim, init_seed=context.seed,
                                                validate_inputs=False)
        self.classifier = ShardedCosineClassifier(classifier_config, context.dims,
                                                  term=config.term(context.views))
        optim = context.optim
        if config.update_in_backward and optim.skips_nonfinite_steps:
            raise ValueError("objective.update_in_backward=true is invalid with optim.on_nonfinite: skip_step: the "
                             "update inside the backward happens before a non-finite step could be skipped; set "
                             "update_in_backward: false (W's gradient then exists for one step) or on_nonfinite: stop")
        if config.update_in_backward:
            self.optimizer = self.classifier.use_in_backward_sgd(0.0, optim.momentum, optim.weight_decay)
        else:  # fused: no W-sized temporaries in the update
            self.optimizer = torch.optim.SGD([self.classifier.weight], lr=0.0, momentum=optim.momentum,
                                             weight_decay=optim.weight_decay, fused=True)
        self.hard_negatives: HardNegativeIndex | None = None
        self.hard_negatives_epoch = -1  # epoch whose search built ``hard_negatives`` (-1: none)
        self.prior_done = False
        self._search_seconds = 0.0

    # -- the seam ------------------------------------------------------------------------------

    # Its per-step state is W and its momentum, stepped by the fused SGD (update_in_backward is
    # refused under skip_step), so a dropped step can be decided on the device.
    skips_on_device = True

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def on_train_start(self, encode, inference_batches) -> None:
        if self.config.contrastive_prior and not self.prior_done:
            contrastive_prior(encode, inference_batches(), self.classifier, self.context.dims)
            self.prior_done = True

    def _smoothing_active(self, epoch: int) -> bool:
        return self.config.smoothing_alpha > 0 and epoch >= self.config.smoothing_start_epoch

    def on_epoch_start(self, epoch: int) -> None:
        self._search_seconds = 0.0
        if self._smoothing_active(epoch) and self.hard_negatives_epoch != epoch:
            start = time.perf_counter()
            table = search_hard_negatives(self.classifier.weight.detach(), self.classifier.shard,
                                          self.classifier.group, self.config.top_k)
            self.hard_negatives = HardNegativeIndex(table, self.classifier.shard, self.classifier.group)
            self.hard_negatives_epoch = epoch
            self._search_seconds = time.perf_counter() - start

    def loss(self, step: StepViews) -> LossOut:
        layout = self.context.views
        features = self.stacked_features(step)
        hard = self.hard_negatives if self._smoothing_active(step.epoch) else None
        loss = self.classifier(
            features, layout.per_view(step.instance_ids), hard, valid=layout.per_view(step.valid),
            global_valid=None if step.global_valid is None else step.global_valid * layout.num_views,
            validate=step.validate,
        )
        return LossOut(loss)

    def after_backward(self) -> None:
        self.classifier.reduce_weight_grad()

    def metrics(self) -> dict[str, float]:
        metrics = {"comm_seconds": self.classifier.comm_timer.drain()}
        if self._search_seconds:
            metrics["hard_negative_search_seconds"] = round(self._search_seconds, 4)
        return metrics

    # -- checkpoints ---------------------------------------------------------------------------

    def _rows(self, tensor: torch.Tensor | None) -> ShardedRows:
        shard, dims = self.classifier.shard, self.context.dims
        # Replicas of a shard (DDP: every rank; DHP: the same shard in other classifier groups) skip writing.
        primary = dims.rank == 0 if self.config.mode == "ddp" else dims.rank < dims.classifier_parallel_size
        return ShardedRows(None if tensor is None else tensor.detach(), shard.class_start, shard.class_end,
                           shard.num_classes, primary)

    def state_dict(self) -> dict:
        momentum = self.optimizer.state.get(self.classifier.weight, {}).get("momentum_buffer")
        table = None if self.hard_negatives is None else self.hard_negatives.owner_table
        return {
            "weight": self._rows(self.classifier.weight),
            "momentum": self._rows(momentum),
            "hard_negatives": self._rows(table),
            "hard_negatives_epoch": self.hard_negatives_epoch,
            "prior_done": self.prior_done,
        }

    def load_state_dict(self, state: dict) -> None:
        device = self.classifier.weight.device
        with torch.no_grad():
            self.classifier.weight.copy_(state["weight"].rows)
        if state["momentum"].rows is not None:
            self.optimizer.state[self.classifier.weight]["momentum_buffer"] = state["momentum"].rows.to(device).clone()
        table = state["hard_negatives"].rows
        if table is not None:
            self.hard_negatives = HardNegativeIndex(table.to(device).clone(), self.classifier.shard,
                                                    self.classifier.group)
        self.hard_negatives_epoch = state["hard_negatives_epoch"]
        self.prior_done = state["prior_done"]


@torch.no_grad()
def contrastive_prior(encode, batches, classifier: ShardedCosineClassifier, dims) -> int:
    """Fill the classifier shard with the L2-normalised features of the random network.

    One pass, no gradients, BatchNorm in train mode (its running statistics update, as in the
    paper).  The owner of a row can be any rank, so features and ids are gathered over all ranks
    and each rank keeps the rows it owns.  Padding repeats are forwarded (every rank must run the
    network each step under ZeRO-3, and BatchNorm needs a batch) but never written; so are samples
    the loader skipped as unreadable (``on_bad_sample: skip``), whose rows keep their random init.
    Returns the rows written here."""
    weight = classifier.weight
    written = torch.zeros(classifier.num_classes_local, dtype=torch.bool, device=weight.device)
    skipped = torch.zeros(1, dtype=torch.int64)
    for batch in batches:
        skipped += len(batch.skipped)
        features = F.normalize(encode(batch.views[0]).float(), dim=1)
        features = gather_rows(features, dims.data_parallel_group)
        ids = gather_rows(batch.instance_ids, dims.data_parallel_group)
        valid = gather_rows(batch.valid, dims.data_parallel_group)
        owned = classifier.shard.is_local(ids) & valid
        rows = ids[owned] - classifier.class_start
        weight.data[rows] = features[owned]
        written[rows] = True
    missing = int((~written).sum())
    if dims.is_distributed:
        dist.all_reduce(skipped, group=dims.control_group)
    if missing > int(skipped):
        raise RuntimeError(f"contrastive prior saw no sample for {missing} of this rank's classes; the inference "
                           "loader must cover every instance (last_batch='pad')")
    if missing:
        print(f"[instcls] rank {dims.rank}: contrastive prior: {missing} rows of unreadable (skipped) samples keep "
              "their random initialisation", file=sys.stderr, flush=True)
    return int(written.sum())
