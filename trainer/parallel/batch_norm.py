"""How BatchNorm layers are shared by the data-parallel ranks: ``model.batch_norm``.

- ``local`` (default; PIC's and One-Million-Way's choice): each rank normalises with its own batch's
  statistics, and each rank's running statistics follow its own batches.  Left alone, the ranks
  then hold T different networks: training-mode forwards never read the running statistics, but
  every evaluation and every saved ``model.pt`` does.  ``averaged_running_statistics`` makes them
  one network (the average over the ranks, as timm's ``distribute_bn`` does): the trainer takes it
  before each evaluation and each save, and that average is what every rank scores and what
  ``model.pt`` holds.  Unlike ``distribute_bn`` it does not write the average back: each rank's own
  statistics are per-rank state (checkpointed per rank, ``trainer.checkpoint.batch_norm_state``),
  so the network saved at step N does not depend on when earlier saves happened, and a resumed run
  is bit-identical to an uninterrupted one.
- ``sync`` (SwAV's choice): every BatchNorm layer becomes ``trainer.parallel.sync_batch_norm``'s
  ``SyncBatchNorm`` over a group of ranks (``model.sync_batch_norm_group``): ``world``, the
  data-parallel group, so the batch statistics of a step are the global batch's and the running
  statistics agree by construction; or ``node``, the ranks of one node (SwAV's code synchronises
  groups of 8 GPUs), whose running statistics agree within the node and are averaged over the
  nodes before each evaluation and save, as under ``local``.  It runs on any device and backend
  (gloo CPU ranks included) and reads nothing on the host, unlike ``torch.nn.SyncBatchNorm``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainer.parallel.collectives import Group, group_size
from trainer.parallel.node_groups import node_group
from trainer.parallel.sync_batch_norm import convert_to_sync_batch_norm

BATCH_NORM_MODES = ("local", "sync")
SYNC_GROUPS = ("world", "node")


def batch_norm_group(mode: str, sync_group: str, dims) -> Group:
    """Collective under ``sync`` with ``node`` (the node groups are created): the group whose ranks
    share statistics; ``dims``: the job's ``ParallelDims``.  None where each rank keeps its own
    (``local``) or in a one-process run."""
    if mode != "sync":
        return None
    if sync_group == "node":
        return node_group(dims.world_size, dims.rank, "model.sync_batch_norm_group=node")
    return dims.data_parallel_group


def statistics_differ_by_rank(mode: str, group: Group, dims) -> bool:
    """Whether the ranks' running statistics differ (and are averaged before each evaluation and
    save): under ``local``, and under ``sync`` over a group smaller than the job."""
    return mode == "local" or (dims.is_distributed and group_size(group) < dims.world_size)


def apply_batch_norm_mode(model: nn.Module, mode: str, group: Group, synchronize_alone: bool = False) -> nn.Module:
    """``model`` with its BatchNorm layers as ``mode`` asks (``sync``: converted in place, the
    state dict's keys unchanged, so checkpoints load in either mode).  ``group``: the ranks that
    share statistics (``batch_norm_group``), None in a one-process run (the layers are then plain
    BatchNorm, unless ``synchronize_alone``: a one-GPU check of the multi-rank path); ``sync`` runs on
    any device."""
    if mode not in BATCH_NORM_MODES:
        raise ValueError(f"model.batch_norm={mode!r} is invalid: use local (per-rank statistics, averaged before "
                         "every evaluation and save) or sync (statistics of the global batch)")
    if mode == "local":
        return model
    return convert_to_sync_batch_norm(model, process_group=group, synchronize_alone=synchronize_alone)


def running_statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every BatchNorm running mean and variance of ``model`` by state-dict name, in module order
    (the same on every rank)."""
    statistics = {}
    for prefix, module in model.named_modules():
        if isinstance(module, _BatchNorm) and module.track_running_stats and module.running_mean is not None:
            dot = f"{prefix}." if prefix else ""
            statistics[f"{dot}running_mean"] = module.running_mean
            statistics[f"{dot}running_var"] = module.running_var
    return statistics


@torch.no_grad()
def averaged_running_statistics(model: nn.Module, group: Group) -> tuple[dict[str, torch.Tensor], float]:
    """Collective: ``({name: the average over group's ranks, float32}, spread)``, where ``spread`` is
    how far the ranks are apart (the largest difference between two ranks' values of one
    statistic; 0.0 for one rank).  The module's own buffers are left as they are: each rank's
    statistics keep following its own batches, so a resumed run stays bit-identical to an
    uninterrupted one however often this was called; the average is what is saved and scored.

    One flat float32 buffer carries all the statistics, so a ResNet-50 costs three all-reduces of
    ~50k values (the sum, and the maximum and minimum that measure the spread)."""
    statistics = running_statistics(model)
    if not statistics:
        return {}, 0.0
    flat = torch.cat([t.detach().float().reshape(-1) for t in statistics.values()])
    spread = 0.0
    if group_size(group) > 1:
        highest, lowest = flat.clone(), -flat
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(lowest, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(flat, group=group)
        flat /= group_size(group)
        spread = float((highest + lowest).max())  # max - min, one host sync (evaluations and saves only)
    averaged, offset = {}, 0
    for name, tensor in statistics.items():
        averaged[name] = flat[offset : offset + tensor.numel()].view(tensor.shape)
        offset += tensor.numel()
    return averaged, spread
