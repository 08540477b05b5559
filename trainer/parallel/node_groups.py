"""The ranks of this rank's node as a process group, from torchrun's environment.

torchrun numbers the ranks node by node: with ``--nproc-per-node P`` the node ``GROUP_RANK`` holds
the global ranks ``GROUP_RANK * P`` to ``GROUP_RANK * P + P - 1`` (``LOCAL_WORLD_SIZE`` is P).  A job
whose nodes run different numbers of ranks has no such blocks, and is refused where node groups are
asked for.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from trainer.parallel.dims import DEFAULT_TIMEOUT_S


def ranks_per_node(world_size: int, rank: int, setting: str) -> int:
    """P, checked against torchrun's numbering; ``setting``: what asked for node groups (named in
    the error)."""
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    node = os.environ.get("GROUP_RANK")
    local_rank = int(os.environ.get("LOCAL_RANK", rank % local_world_size))
    if (world_size % local_world_size or local_rank >= local_world_size
            or (node is not None and rank != int(node) * local_world_size + local_rank)):
        raise ValueError(
            f"{setting} needs every node to run the same number of ranks, numbered node by node, but rank {rank} of "
            f"{world_size} is local rank {local_rank} of {local_world_size} on node {node}. Launch every node with "
            "the same --nproc-per-node (as `instcls launch` and the k8s manifests do), or use the world group")
    return local_world_size


def node_group(world_size: int, rank: int, setting: str,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.ProcessGroup | None:
    """Collective (every rank creates every node's group, in order): this rank's node's group; the
    default group when the job is one node; None in a single process."""
    if world_size <= 1 or not dist.is_initialized():
        return None
    size = ranks_per_node(world_size, rank, setting)
    if size == world_size:
        return dist.group.WORLD
    mine = None
    timeout = datetime.timedelta(seconds=timeout_s)
    for first in range(0, world_size, size):
        group = dist.new_group(list(range(first, first + size)), timeout=timeout)
        if first <= rank < first + size:
            mine = group
    return mine
