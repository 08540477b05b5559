"""How BatchNorm layers are shared by the data-parallel ranks: ``model.batch_norm``.

- ``local`` (default; PIC's and paper 000's choice): each rank normalises with its own batch's
  statistics, and each rank's running statistics follow its own batches.  Left alone, the ranks
  then hold T different networks: training-mode forwards never read the running statistics, but
  every evaluation and every saved ``model.pt`` does.  ``average_running_statistics`` makes them
  one network (timm's ``distribute_bn`` pattern): the trainer calls it before each evaluation and
  each save, so what is scored, what is saved and what every rank holds are the same weights.
  Because nothing in a training step reads the running statistics, averaging them does not move
  the trajectory: a resumed run stays bit-identical to an uninterrupted one.
- ``sync`` (SwAV's choice): ``torch.nn.SyncBatchNorm`` over the data-parallel group; the batch
  statistics of a step are the global batch's, so the running statistics agree by construction.
  It runs on CUDA only (PyTorch refuses CPU tensors when more than one rank takes part), so a
  ``sync`` job on CPU ranks is refused with that reason.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainer.parallel.collectives import Group, group_size

BATCH_NORM_MODES = ("local", "sync")


def apply_batch_norm_mode(model: nn.Module, mode: str, device: torch.device, world_size: int,
                          group: Group) -> nn.Module:
    """``model`` with its BatchNorm layers as ``mode`` asks (``sync``: converted in place, the
    state dict's keys unchanged, so checkpoints load in either mode)."""
    if mode not in BATCH_NORM_MODES:
        raise ValueError(f"model.batch_norm={mode!r} is invalid: use local (per-rank statistics, averaged before "
                         "every evaluation and save) or sync (SyncBatchNorm, CUDA only)")
    if mode == "local":
        return model
    if device.type != "cuda" and world_size > 1:
        raise ValueError(f"model.batch_norm=sync needs CUDA devices: torch.nn.SyncBatchNorm refuses CPU tensors "
                         f"when more than one rank takes part, and this job runs {world_size} ranks on {device}. "
                         "Use model.batch_norm=local on CPU ranks (the running statistics are still averaged "
                         "over the ranks before every evaluation and save)")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)


def running_statistics(model: nn.Module) -> list[torch.Tensor]:
    """Every BatchNorm running mean and variance of ``model``, in module order (the same on every rank)."""
    tensors = []
    for module in model.modules():
        if isinstance(module, _BatchNorm) and module.track_running_stats and module.running_mean is not None:
            tensors += [module.running_mean, module.running_var]
    return tensors


@torch.no_grad()
def average_running_statistics(model: nn.Module, group: Group) -> float:
    """Collective: every rank's BatchNorm running means and variances replaced, in place, by their
    average over ``group``; returns how far the ranks were apart before (the largest difference
    between two ranks' values of one statistic; 0.0 for one rank).  ``num_batches_tracked`` is
    not touched: every rank has run the same number of steps.

    One flat float32 buffer carries all the statistics, so a ResNet-50 costs three all-reduces of
    ~50k values (the sum, and the maximum and minimum that measure the spread).  The average is
    formed in float32 whatever the module's dtype (bf16 under a bf16 engine), then rounded back."""
    tensors = running_statistics(model)
    if not tensors or group_size(group) <= 1:
        return 0.0
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    highest, lowest = flat.clone(), -flat
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lowest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(flat, group=group)
    flat /= group_size(group)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return float((highest + lowest).max())  # max - min, one host sync (evaluations and saves only)
