"""One rank's measured training steps of the classifier written with torch's op, the counterpart of
``run_steps`` (``trainer.bench.step_runner``) for the same problem.

The same rows (instcls's initial W), the same ids and features on each rank, the same loss, and the
same row update: the fused SGD run_steps gives the rows when they are updated after the backward.
With several ranks the rows are replicated and their gradient averaged (DDP): ``all_reduce`` of
the full ``N x D`` gradient, timed as the step's communication.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from statistics import fmean

import torch
import torch.distributed as dist

from trainer.bench.step_runner import ROW_SGD, StepStats, synchronize
from trainer.bench.torch_op import TorchOpChoice, cosine_cross_entropy
from trainer.classifier import ClassifierConfig
from trainer.classifier.sharded_classifier import gaussian_rows
from trainer.parallel import ParallelDims


@dataclass(frozen=True)
class TorchOpSpec:
    num_classes: int
    batch: int  # global: batch / T per rank
    dim: int = 128
    dtype: str = "float32"
    steps: int = 3
    warmup: int = 1

    def classifier_config(self) -> ClassifierConfig:
        """instcls's classifier of run_steps for these shapes: its temperature and initial rows."""
        return ClassifierConfig(num_classes=self.num_classes, feature_dim=self.dim, validate_inputs=False)


def synthetic_batch(num_classes: int, local_batch: int, dim: int, dtype: torch.dtype, device: torch.device,
                    rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, features)`` of rank ``rank``, drawn as run_steps draws them (its generator, seeded
    with the rank, gives the ids first); the features require their gradient."""
    generator = torch.Generator(device=device).manual_seed(rank)
    ids = torch.randint(0, num_classes, (local_batch,), device=device, generator=generator)
    features = torch.randn(local_batch, dim, device=device, dtype=dtype, generator=generator)
    return ids, features.requires_grad_()


def initial_rows(config: ClassifierConfig, device: torch.device) -> torch.nn.Parameter:
    """All N rows as instcls's classifier starts them (the same rows under any sharding)."""
    rows = gaussian_rows(0, config.num_classes, config.feature_dim, config.init_std, config.init_seed)
    return torch.nn.Parameter(rows.to(device))


def run_torch_op_steps(spec: TorchOpSpec, choice: TorchOpChoice, dims: ParallelDims) -> StepStats:
    """Warm-up, then timed steps: loss, backward, (several ranks) the gradient's all-reduce, SGD."""
    device, dtype = dims.device, getattr(torch, spec.dtype)
    config = spec.classifier_config()
    weight = initial_rows(config, device)
    optimizer = torch.optim.SGD([weight], **ROW_SGD, fused=True)
    ids, features = synthetic_batch(spec.num_classes, spec.batch // dims.world_size, spec.dim, dtype, device,
                                    dims.rank)
    distributed = dist.is_initialized()
    step_times, sync_times = [], []
    for step in range(spec.warmup + spec.steps):
        if distributed:
            dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad()
        cosine_cross_entropy(features, weight, ids, config.temperature, choice).backward()
        synchronize(device)
        sync_start = time.perf_counter()
        if dims.world_size > 1:  # what DDP does with a replicated parameter's gradient
            weight.grad.div_(dims.world_size)
            dist.all_reduce(weight.grad)
        synchronize(device)
        sync_s = time.perf_counter() - sync_start
        optimizer.step()
        synchronize(device)
        if step >= spec.warmup:
            step_times.append(time.perf_counter() - start)
            sync_times.append(sync_s)
    return StepStats(step_s=fmean(step_times), comm_s=fmean(sync_times), weight_grad_sync_s=fmean(sync_times),
                     num_classes_local=spec.num_classes)
