"""The instance classifier as an ``nn.Module``: DHP (class-sharded) or replicated (DDP baseline).

DHP, per step on rank r of a classifier group of size T::

    features [b, D] --normalise--> all-gather (backward: reduce-scatter) --> x [B = b*T, D]
    x vs local shard W_r [N/T, D] --> chunked cosine softmax CE with 2 all-reduces --> loss

The weight gradient stays on its rank; only when several classifier groups replicate the
classifier is it averaged over the ranks holding the same shard (``reduce_weight_grad``).

Replicated: every rank holds all of W, scores only its local batch, and ``reduce_weight_grad``
all-reduces (averages) the full N x D gradient over all ranks, which is what DDP would do.

Loss scale: DHP returns the mean over the classifier group's batch (the same on each of its ranks);
replicated returns the mean over the local batch.  Either way, after ``reduce_weight_grad`` W's
gradient is that of the mean over the whole global batch, and averaging backbone gradients over
all ranks gives the backbone's exact gradient of that mean (see ``backbone_grads_averaged``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.classifier.config import ClassifierConfig
from trainer.classifier.in_backward_sgd import InBackwardSGD
from trainer.classifier.sharding import ClassShard
from trainer.classifier.softmax_ce import ShardedCosineSoftmaxCE
from trainer.classifier.validation import check_inputs_on_all_ranks, local_input_problem
from trainer.parallel.collectives import CommTimer, all_gather_rows_with_grad, all_reduce_, gather_rows, group_size, scale_grad
from trainer.parallel.dims import ParallelDims

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
    def __init__(self, config: ClassifierConfig, dims: ParallelDims) -> None:
        super().__init__()
        self.config = config
        self.dims = dims
        if config.mode == "dhp":
            self.shard = ClassShard(config.num_classes, dims.classifier_parallel_size, dims.classifier_rank)
            self.group = dims.classifier_group
            self.grad_group = dims.classifier_replica_group
            self.feature_grad_scale = dims.classifier_parallel_size if config.backbone_grads_averaged else 1
        else:
            self.shard = ClassShard(config.num_classes, 1, 0)
            self.group = None
            self.grad_group = dims.data_parallel_group
            self.feature_grad_scale = 1
        rows = gaussian_rows(
            self.shard.class_start, self.shard.num_classes_local, config.feature_dim, config.init_std, config.init_seed
        )
        self.weight = nn.Parameter(rows.to(dims.device))
        self.comm_timer = CommTimer()  # time in this classifier's collectives (drained by the trainer)
        self.update_in_backward = None

    def use_in_backward_sgd(self, lr: float, momentum: float, weight_decay: float):
        """Apply SGD to each chunk of W during the backward, so W's full gradient never exists
        (see ``InBackwardSGD``); returns the optimizer for the schedule and checkpoints."""
        if self.grad_group is not None:
            raise ValueError(
                "classifier.update_in_backward needs mode 'dhp' with a single classifier group: the shard's gradient "
                "would otherwise have to be averaged across ranks before the update"
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
        hard_negative_ids: torch.Tensor | None = None,
        validate: bool | None = None,
    ) -> torch.Tensor:
        """Loss of a local batch.

        Args:
            features: ``[b, D]`` un-normalised head outputs of this rank (fp32/bf16/fp16).
            instance_ids: ``[b]`` global instance ids (the targets).
            hard_negative_ids: ``[b, K]`` hard negatives per sample; used only when
                ``smoothing_alpha > 0`` (before the first search there are none: pass ``None``).
            validate: check the inputs on this call (collective; default ``config.validate_inputs``).
                A trainer checks on log steps only, where it syncs anyway.
        """
        config = self.config
        use_smoothing = config.smoothing_alpha > 0 and hard_negative_ids is not None
        if config.validate_inputs if validate is None else validate:
            problem = local_input_problem(
                features,
                instance_ids,
                hard_negative_ids if use_smoothing else None,
                config.num_classes,
                config.feature_dim,
            )
            check_inputs_on_all_ranks(problem, features.shape[0], self.dims.data_parallel_group, features.device)

        targets, target_weights = self._targets(instance_ids, hard_negative_ids if use_smoothing else None)
        features = scale_grad(F.normalize(features, dim=1), self.feature_grad_scale)
        features = all_gather_rows_with_grad(features, self.group, self.comm_timer)
        targets = gather_rows(targets, self.group, self.comm_timer)
        target_cols = torch.where(self.shard.is_local(targets), targets - self.class_start, -1)
        per_sample = ShardedCosineSoftmaxCE.apply(
            features,
            self.weight,
            target_cols,
            target_weights.expand(targets.shape[0], -1),
            config.temperature,
            config.chunk_size,
            config.form,
            self.group,
            self.comm_timer,
            self.update_in_backward,
        )
        return per_sample.mean()

    def _targets(
        self, instance_ids: torch.Tensor, hard_negative_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ids ``[b, 1 + K]`` (instance first) and their weights ``[1, 1 + K]``."""
        ids = instance_ids.long()[:, None]
        device = instance_ids.device
        if hard_negative_ids is None:
            return ids, torch.ones(1, 1, device=device)
        alpha = self.config.smoothing_alpha
        top_k = hard_negative_ids.shape[1]
        weights = torch.full((1, 1 + top_k), alpha / top_k, device=device)
        weights[0, 0] = 1.0 - alpha
        return torch.cat([ids, hard_negative_ids.long()], dim=1), weights

    @torch.no_grad()
    def reduce_weight_grad(self) -> None:
        """Average W's gradient over the ranks that hold the same rows (call after backward).

        A no-op for DHP with a single classifier group: each shard's gradient is already exact.
        """
        if self.weight.grad is not None and self.grad_group is not None:
            self.weight.grad.div_(group_size(self.grad_group))
            all_reduce_(self.weight.grad, dist.ReduceOp.SUM, self.grad_group, self.comm_timer)

    @torch.no_grad()
    def load_full_weight(self, full_weight: torch.Tensor) -> None:
        """Copy this rank's rows out of a full ``[N, D]`` matrix."""
        if full_weight.shape != (self.config.num_classes, self.config.feature_dim):
            raise ValueError(
                f"full weight has shape {tuple(full_weight.shape)}, expected "
                f"({self.config.num_classes}, {self.config.feature_dim})"
            )
        self.weight.copy_(full_weight[self.class_start : self.shard.class_end])
