"""The parallel layout of a job, built once from torchrun's environment and passed explicitly.

Two kinds of group matter:

* the data-parallel group spans every rank; DeepSpeed averages backbone gradients over it;
* the classifier (tensor-parallel) groups split the ranks into consecutive blocks of
  ``classifier_parallel_size``.  Each block holds one complete copy of the N-way classifier,
  sharded by class range.  When there is more than one block, the ranks that hold the *same*
  class range in different blocks form a ``classifier_replica_group`` over which the shard's
  gradient is averaged (exactly like data parallelism, but per shard).

Nothing here is stored in module globals: code that needs a group receives a ``ParallelDims``.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer.parallel.device_choice import choose_device

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 600.0  # how long a collective waits for the slowest rank


@dataclass(frozen=True)
class ParallelDims:
    """Where this process sits in the job.

    ``classifier_group`` / ``classifier_replica_group`` are ``None`` when they contain a single
    rank: collectives over them are then skipped rather than issued on a trivial group.
    """

    world_size: int
    rank: int
    local_rank: int
    classifier_parallel_size: int
    device: torch.device
    backend: str | None
    classifier_group: dist.ProcessGroup | None = field(default=None, repr=False)
    classifier_replica_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # gloo over all ranks: small CPU-side agreements (stop flags) that must not sync the GPU.
    control_group: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def classifier_rank(self) -> int:
        """Index of this rank's class shard inside its classifier group."""
        return self.rank % self.classifier_parallel_size

    @property
    def num_classifier_replicas(self) -> int:
        """How many complete copies of the classifier exist (world / classifier group size)."""
        return self.world_size // self.classifier_parallel_size

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """All ranks (the default group), or ``None`` in a single-process run."""
        return dist.group.WORLD if self.is_distributed else None


def default_device(local_rank: int, requested: str = "auto", local_world_size: int | None = None) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is present, else the CPU (see ``device_choice``)."""
    return choose_device(requested, local_rank, local_world_size)


def default_backend(device: torch.device) -> str:
    """NCCL for GPU tensors, gloo for CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def single_process_dims(device: torch.device | None = None) -> ParallelDims:
    """Layout of a plain single-process run (no process group needed)."""
    return ParallelDims(
        world_size=1,
        rank=0,
        local_rank=0,
        classifier_parallel_size=1,
        device=device if device is not None else default_device(0),
        backend=None,
    )


def _check_classifier_size(classifier_parallel_size: int, world_size: int) -> None:
    if classifier_parallel_size < 1 or world_size % classifier_parallel_size != 0:
        raise ValueError(
            f"classifier_parallel_size={classifier_parallel_size} must be a positive divisor of the "
            f"world size {world_size}; pick one of "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]} "
            "(or leave it unset to shard the classifier over all ranks)."
        )


SHARED_STORE_WARNING = (
    "instcls: this multi-node job shares torchrun's agent store across restarts (TORCHELASTIC_USE_AGENT_STORE=True): "
    "torchrun counts a restart only on the node whose workers failed, so after a lost node the nodes may wait under "
    "different keys until init's timeout. Launch with `instcls launch --rdzv-backend c10d` (it sets "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh store per rendezvous round), or set that variable for torchrun.")


def _store_of_this_attempt(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The agent's store, its keys prefixed by the elastic restart count (None: the default env:// init).

    A fresh store per attempt is the safe case and needs nothing here: a dynamic rendezvous with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``instcls launch`` sets it) has rank 0 host a new
    store on a new port each round.  Otherwise torchrun keeps one store across restarts, and env://
    init adds no per-attempt prefix, so a restarted job would read the killed attempt's gloo/NCCL
    addresses and fail to connect ("Connection refused").  On one node the restart count is a prefix
    every rank agrees on; across nodes it is not (a node restarted because another node left does
    not count up, a replacement pod starts at 0), hence the warning.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and os.environ.get("RANK") == "0":
        print(SHARED_STORE_WARNING, file=sys.stderr, flush=True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"instcls/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(
    classifier_parallel_size: int | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device: str = "auto",
) -> ParallelDims:
    """Join the job described by torchrun's environment variables and build the groups.

    Without ``WORLD_SIZE`` in the environment this is a single-process run and no process group
    is created.  ``classifier_parallel_size`` defaults to the world size (the classifier is
    sharded over every rank, the paper's DHP setting).  ``device`` is ``parallel.device``.
    ``timeout_s``: every group's collective timeout (``new_group`` would otherwise give gloo
    groups 30 minutes, whatever the job's own).
    """
    if "WORLD_SIZE" not in os.environ:
        dims = single_process_dims(default_device(0, device))
        _check_classifier_size(classifier_parallel_size or 1, 1)
        return dims

    missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE is set but {', '.join(missing)} is not; launch with `torchrun` "
            "(or the `deepspeed` launcher), which sets all of " + ", ".join(_TORCHRUN_VARS) + "."
        )
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    classifier_parallel_size = classifier_parallel_size or world_size
    _check_classifier_size(classifier_parallel_size, world_size)

    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    device = default_device(local_rank, device, local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or default_backend(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            store=_store_of_this_attempt(world_size, timeout),
        )

    classifier_group, replica_group = build_classifier_groups(world_size, rank, classifier_parallel_size, timeout)
    control_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return ParallelDims(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        classifier_parallel_size=classifier_parallel_size,
        device=device,
        backend=backend,
        classifier_group=classifier_group,
        classifier_replica_group=replica_group,
        control_group=control_group,
    )


def build_classifier_groups(
    world_size: int, rank: int, size: int, timeout: datetime.timedelta
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Consecutive blocks of ``size`` ranks, and the ranks holding the same shard across blocks;
    ``timeout``: their collectives' (the job's).

    ``dist.new_group`` is collective: every rank creates every group, in the same order, and
    keeps the ones it belongs to.
    """
    classifier_group = replica_group = None
    if size > 1:
        for start in range(0, world_size, size):
            ranks = list(range(start, start + size))
            group = dist.new_group(ranks, timeout=timeout) if size < world_size else dist.group.WORLD
            if rank in ranks:
                classifier_group = group
    num_replicas = world_size // size
    if num_replicas > 1:
        for shard in range(size):
            ranks = list(range(shard, world_size, size))
            group = dist.new_group(ranks, timeout=timeout) if num_replicas < world_size else dist.group.WORLD
            if rank in ranks:
                replica_group = group
    return classifier_group, replica_group


def shutdown_distributed() -> None:
    """Destroy the default process group if this process created one.  Where DeepSpeed used it, its
    own ``destroy_process_group`` does it: DeepSpeed keeps a copy of the world group, which the next
    job of the same process (a notebook's second ``trainer.train``) would otherwise find dead."""
    if not dist.is_initialized():
        return
    deepspeed_comm = sys.modules.get("deepspeed.comm")  # never imported for this: present only if used
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        deepspeed_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
