"""One rank's measured training steps of the classifier (optionally behind a real backbone), shared
by `bench classifier` and `bench ddp-vs-dhp`.

Everything is synthetic but real: random images or features, the real classifier in the chosen
mode, a real SGD with momentum (fused, or applied inside the backward), and for the backbone a
torchvision ResNet whose gradients are averaged over the ranks the way DDP/DeepSpeed do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from statistics import fmean
from typing import Callable

import torch
import torch.distributed as dist

from trainer.bench.settings.float_dtypes import FLOAT_DTYPES, FloatDtype
from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
from trainer.parallel import ParallelDims

__all__ = ["FLOAT_DTYPES", "ROW_SGD", "FloatDtype", "StepSpec", "StepStats", "run_steps", "synchronize"]

ROW_SGD = dict(lr=0.1, momentum=0.9, weight_decay=1e-4)  # the classifier rows' SGD in every measured step


@dataclass(frozen=True)
class StepSpec:
    num_classes: int
    batch: int  # global images per step (batch / T per rank)
    dim: int = 128
    chunk_size: int = 65536
    mode: str = "dhp"  # "dhp" (sharded W) or "ddp" (replicated W, the baseline)
    logits_cache_bytes: int = 0  # keep the forward's logits for the backward when they fit (0: recompute)
    dtype: str = "float32"
    steps: int = 3
    warmup: int = 1
    update_in_backward: bool = False  # DHP only: W's gradient never exists in full
    backbone: str | None = None  # e.g. "resnet18": add its forward/backward on random images
    image_size: int = 64
    kernel: str = "auto"  # the classifier's path (KernelSettings.implementation)


@dataclass
class StepStats:
    step_s: float
    comm_s: float  # classifier collectives + (ddp) the W-gradient all-reduce
    weight_grad_sync_s: float
    num_classes_local: int


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(spec: StepSpec, dims: ParallelDims, after_step: Callable[[], None] | None = None) -> StepStats:
    """Warm-up, then timed steps; ``after_step`` runs after each timed step, outside its timing (the
    bench times its matmul roofline there, so both see the same moments of a noisy machine)."""
    device, dtype = dims.device, getattr(torch, spec.dtype)
    local_batch = spec.batch // dims.world_size
    classifier = ShardedCosineClassifier(
        ClassifierConfig(num_classes=spec.num_classes, feature_dim=spec.dim, chunk_size=spec.chunk_size,
                         mode=spec.mode, logits_cache_bytes=spec.logits_cache_bytes, validate_inputs=False,
                         kernel=spec.kernel),
        dims,
    )
    if spec.update_in_backward:
        optimizer = classifier.use_in_backward_sgd(**ROW_SGD)
    else:  # fused: no W-sized temporaries in the update
        optimizer = torch.optim.SGD([classifier.weight], **ROW_SGD, fused=True)
    generator = torch.Generator(device=device).manual_seed(dims.rank)
    ids = torch.randint(0, spec.num_classes, (local_batch,), device=device, generator=generator)
    backbone = backbone_optimizer = None
    if spec.backbone:
        # Imported here: torchvision (and torch._dynamo under it) costs each spawned rank seconds of
        # start-up, and the classifier-only runs never use it.
        from trainer.models import ModelConfig, build_model

        backbone = build_model(ModelConfig(arch=spec.backbone, head_hidden_dim=512, feature_dim=spec.dim)).to(device)
        backbone_optimizer = torch.optim.SGD(backbone.parameters(), lr=0.01, momentum=0.9)
        inputs = torch.randn(local_batch, 3, spec.image_size, spec.image_size, device=device, generator=generator)
    else:
        inputs = torch.randn(local_batch, spec.dim, device=device, dtype=dtype, generator=generator).requires_grad_()

    step_times, comm_times, sync_times = [], [], []
    for step in range(spec.warmup + spec.steps):
        dist.barrier()
        synchronize(device)
        classifier.comm_timer.drain()
        start = time.perf_counter()
        optimizer.zero_grad()
        features = inputs if backbone is None else backbone(inputs).to(dtype)
        classifier(features, ids).backward()
        synchronize(device)
        sync_start = time.perf_counter()
        classifier.reduce_weight_grad()
        synchronize(device)
        sync_s = time.perf_counter() - sync_start
        optimizer.step()
        if backbone is not None:
            for parameter in backbone.parameters():  # what DDP does with backbone gradients
                dist.all_reduce(parameter.grad)
                parameter.grad.div_(dims.world_size)
            backbone_optimizer.step()
            backbone_optimizer.zero_grad()
        synchronize(device)
        if step >= spec.warmup:
            step_times.append(time.perf_counter() - start)
            comm_times.append(classifier.comm_timer.drain())
            sync_times.append(sync_s)
            if after_step is not None:
                after_step()
    return StepStats(
        step_s=fmean(step_times), comm_s=fmean(comm_times), weight_grad_sync_s=fmean(sync_times),
        num_classes_local=classifier.num_classes_local,
    )
