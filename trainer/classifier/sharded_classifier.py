"""The instance classifier as an ``nn.Module``: DHP (class-sharded) or DDP (replicated, the baseline).

DHP, per step on rank r of a classifier group of size T::

    features [b, D] --normalise--> all-gather (backward: reduce-scatter) --> x [B = b*T, D]
    x vs local shard W_r [N/T, D] --> chunked cosine softmax CE with 2 all-reduces --> loss

The weight gradient stays on its rank; only when several classifier groups replicate the
classifier is it averaged over the ranks holding the same shard (``reduce_weight_grad``).

DDP: every rank holds all of W, scores only its local batch, and ``reduce_weight_grad``
all-reduces (averages) the full N x D gradient over all ranks, which is what DDP would do.

Loss scale: DHP returns the mean over the classifier group's batch (the same on each of its ranks);
DDP returns the mean over the local batch; padding repeats (``valid`` False) count in neither
(see ``_loss_denominator``).  Either way, after ``reduce_weight_grad`` W's
gradient is that of the mean over the whole global batch, and averaging backbone gradients over
all ranks gives the backbone's exact gradient of that mean (see ``backbone_grads_averaged``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from data_pipeline.contract import ViewLayout
from trainer.classifier.classifier_config import ClassifierConfig
from trainer.classifier.hard_negatives import HardNegativeIndex
from trainer.classifier.head import CosineHead
from trainer.classifier.in_backward_sgd import InBackwardSGD
from trainer.classifier.sharding import ClassShard
from trainer.classifier.terms.chunk_term import ChunkTerm
from trainer.classifier.validation import check_inputs_on_all_ranks, local_input_problem, poison_out_of_range
from trainer.parallel.collectives import CommTimer, all_reduce_, gather_rows, group_size
from trainer.parallel.dims import ParallelDims

_CONFIG_TERM = object()  # ShardedCosineClassifier's default: the term its config chooses
INIT_BLOCK_ROWS = 65536  # rows drawn from one seeded generator; fixed so W never depends on sharding


def gaussian_rows(class_start: int, num_rows: int, dim: int, std: float, seed: int) -> torch.Tensor:
    """Rows ``[class_start, class_start + num_rows)`` of an N x D Gaussian matrix, identical for
    any split of N: each block of ``INIT_BLOCK_ROWS`` global rows has its own seeded generator."""
    out = torch.empty(num_rows, dim)
    first_block = class_start // INIT_BLOCK_ROWS
    last_block = (class_start + num_rows - 1) // INIT_BLOCK_ROWS
    for block in range(first_block, last_block + 1):
        block_start = block * INIT_BLOCK_ROWS
        generator = torch.Generator().manual_seed(seed * 1_000_003 + block)
        rows = torch.randn(INIT_BLOCK_ROWS, dim, generator=generator).mul_(std)
        lo = max(class_start, block_start)
        hi = min(class_start + num_rows, block_start + INIT_BLOCK_ROWS)
        out[lo - class_start : hi - class_start] = rows[lo - block_start : hi - block_start]
    return out


class ShardedCosineClassifier(nn.Module):
    """``views``: the layout of the features it is given (one global view when None); a term such
    as CO2 pairs the views of an image through it.  ``term``: the per-sample term fused into the
    kernel, None for none (default: the one ``config`` chooses for ``views``, e.g. CO2 when
    ``co2_alpha > 0``)."""

    def __init__(self, config: ClassifierConfig, dims: ParallelDims, views: ViewLayout | None = None,
                 term: ChunkTerm | None | object = _CONFIG_TERM) -> None:
        super().__init__()
        self.config = config
        self.dims = dims
        if config.mode == "dhp":
            self.shard = ClassShard(config.num_classes, dims.classifier_parallel_size, dims.classifier_rank)
            self.group = dims.classifier_group
            self.grad_group = dims.classifier_replica_group
            feature_grad_scale = dims.classifier_parallel_size if config.backbone_grads_averaged else 1
        else:
            self.shard = ClassShard(config.num_classes, 1, 0)
            self.group = None
            self.grad_group = dims.data_parallel_group
            feature_grad_scale = 1
        rows = gaussian_rows(
            self.shard.class_start, self.shard.num_classes_local, config.feature_dim, config.init_std, config.init_seed
        )
        self.weight = nn.Parameter(rows.to(dims.device))
        self.comm_timer = CommTimer()  # time in this classifier's collectives (drained by the trainer)
        if term is _CONFIG_TERM:
            term = config.term(views or ViewLayout.single())
        self.head = CosineHead(config.kernel_settings(), self.group, feature_grad_scale, term, self.comm_timer)
        self.update_in_backward = None

    def use_in_backward_sgd(self, lr: float, momentum: float, weight_decay: float):
        """Apply SGD to each chunk of W during the backward, so W's full gradient never exists
        (see ``InBackwardSGD``); returns the optimizer for the schedule and checkpoints."""
        if self.grad_group is not None:
            raise ValueError(
                "update_in_backward=true is invalid here: it needs mode 'dhp' with a single classifier group "
                "(parallel.classifier_parallel_size = world size); the shard's gradient would otherwise have to be "
                "averaged across ranks before the update"
            )
        self.update_in_backward = InBackwardSGD(self.weight, lr, momentum, weight_decay)
        return self.update_in_backward

    @property
    def class_start(self) -> int:
        return self.shard.class_start

    @property
    def num_classes_local(self) -> int:
        return self.shard.num_classes_local

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"mode={c.mode}, classes=[{self.class_start}, {self.shard.class_end}) of {c.num_classes}, "
            f"dim={c.feature_dim}, tau={c.temperature}, chunk={c.chunk_size}"
        )

    def forward(
        self,
        features: torch.Tensor,
        instance_ids: torch.Tensor,
        hard_negatives: torch.Tensor | HardNegativeIndex | None = None,
        valid: torch.Tensor | None = None,
        global_valid: int | None = None,
        validate: bool | None = None,
    ) -> torch.Tensor:
        """Loss of a local batch.

        Args:
            features: ``[b, D]`` un-normalised head outputs of this rank (fp32/bf16/fp16).
            instance_ids: ``[b]`` global instance ids (the targets).
            hard_negatives: used only when ``smoothing_alpha > 0`` (before the first search there
                are none: pass ``None``). Either explicit ``[b, K]`` ids per sample, gathered with the
                ids, or a ``HardNegativeIndex``, looked up locally with no communication.
            valid: ``[b]`` bool; False marks padding repeats (the last batch of an epoch), which add
                nothing to the loss or to any gradient.
            global_valid: valid samples over *all* ranks this step (the sampler knows it without
                communication).  With padding it makes the loss exactly the mean over the valid
                samples of the global batch, whatever the classifier-group layout; without it the
                groups are assumed to hold equal numbers of valid samples.
            validate: check the inputs on this call (collective; default ``config.validate_inputs``).
                A trainer checks on log steps only, where it syncs anyway.
        """
        config = self.config
        use_smoothing = config.smoothing_alpha > 0 and hard_negatives is not None
        explicit_negatives = hard_negatives if use_smoothing and isinstance(hard_negatives, torch.Tensor) else None
        if config.validate_inputs if validate is None else validate:
            problem = local_input_problem(features, instance_ids, explicit_negatives, config.num_classes,
                                          config.feature_dim)
            check_inputs_on_all_ranks(problem, features.shape[0], self.dims.data_parallel_group, features.device)

        if valid is None:
            valid = torch.ones_like(instance_ids, dtype=torch.bool)
        # One gather carries the ids, the valid marks and any explicit hard negatives.
        columns = [instance_ids.long()[:, None], valid.long()[:, None]]
        if explicit_negatives is not None:
            columns.append(explicit_negatives.long())
        gathered = gather_rows(torch.cat(columns, dim=1), self.group, self.comm_timer)
        all_ids, all_valid = gathered[:, 0], gathered[:, 1].to(torch.float32)
        targets = gathered[:, :1] if explicit_negatives is None else gathered[:, [0, *range(2, gathered.shape[1])]]
        target_cols = torch.where(self.shard.is_local(targets), targets - self.class_start, -1)
        if use_smoothing and explicit_negatives is None:
            target_cols = torch.cat([target_cols, hard_negatives.local_columns(all_ids)], dim=1)

        target_weights = self._target_weights(target_cols.shape[1] - 1, features.device)
        target_weights = target_weights.expand(target_cols.shape[0], -1)
        loss_sum = self.head.loss_sum(features, self.weight, target_cols, target_weights, all_valid,
                                      update_in_backward=self.update_in_backward,
                                      check=lambda loss: poison_out_of_range(loss, targets, config.num_classes))
        return loss_sum / self._loss_denominator(all_valid, global_valid)

    def _target_weights(self, top_k: int, device: torch.device) -> torch.Tensor:
        """``[1, 1 + K]``: the instance's ``1 - alpha``, then ``alpha / K`` per hard negative.  Built
        from fills only (an element assignment copies a host scalar into the device tensor, which
        can make the host wait every step)."""
        if top_k == 0:
            return torch.ones(1, 1, device=device)
        alpha = self.config.smoothing_alpha
        return torch.cat([torch.full((1, 1), 1.0 - alpha, device=device),
                          torch.full((1, top_k), alpha / top_k, device=device)], dim=1)

    def _loss_denominator(self, scored_valid: torch.Tensor, global_valid: int | None):
        """What the sum of this rank's scored losses is divided by.

        Every rank's loss is its replica group's share of the global mean, scaled so that averaging
        gradients over the replicas (``reduce_weight_grad``; DeepSpeed for the backbone) gives the
        exact gradient of the mean over all valid samples: ``n_global / replicas`` with ``replicas``
        the number of classifier groups (DHP) or of ranks (DDP).  With full batches this is the
        mean over the scored batch, as before.
        """
        replicas = self.dims.world_size // group_size(self.group)
        if global_valid is None:
            return scored_valid.sum().clamp_min(1.0)  # on the device: no host sync
        return max(global_valid, 1) / replicas

    @torch.no_grad()
    def reduce_weight_grad(self) -> None:
        """Average W's gradient over the ranks that hold the same rows (call after backward).

        A no-op for DHP with a single classifier group: each shard's gradient is already exact.
        """
        if self.weight.grad is not None and self.grad_group is not None:
            self.weight.grad.div_(group_size(self.grad_group))
            all_reduce_(self.weight.grad, dist.ReduceOp.SUM, self.grad_group, self.comm_timer)
