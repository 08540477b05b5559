"""The collectives a rank issues, in order, and where simulated ranks disagree about them.

Ranks of a group must issue the same collectives on it in the same order with the same shapes;
otherwise NCCL waits forever (or reads garbage).  ``CollectiveRecorder`` sees every ``c10d`` op a
step dispatches (``dist.all_reduce`` and the rest reach the dispatcher as ``c10d.*`` ops, also
under the ``fake`` process group) and keeps its group's ranks, its tensors' shapes and dtypes and
the source line.  ``first_disagreement`` compares the records of several simulated ranks group by
group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer.dry_run.host_syncs import caller


@dataclass(frozen=True)
class Collective:
    op: str  # e.g. "allreduce_"
    group: tuple[int, ...]  # the group's global ranks
    tensors: tuple[str, ...]  # "bfloat16[64, 128]" per tensor argument, in order
    where: str

    @property
    def signature(self) -> tuple:
        """What every rank of the group must agree on: not the source line, and not the shapes of an
        all-to-all, whose splits may differ by rank (then the dtypes only)."""
        if self.op.startswith("alltoall"):
            return self.op, self.group, tuple(t.split("[")[0] for t in self.tensors)
        return self.op, self.group, self.tensors

    def __str__(self) -> str:
        return f"{self.op} on ranks {_ranks_text(self.group)} of {', '.join(self.tensors)} at {self.where}"


def _ranks_text(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _group_ranks(args) -> tuple[int, ...]:
    for value in args:
        if isinstance(value, torch.ScriptObject) and value._type().name() == "ProcessGroup":
            return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(value)))
    return ()


class CollectiveRecorder(TorchDispatchMode):
    """``with FakeTensorMode(), CollectiveRecorder() as recorder: ...`` then ``recorder.collectives``."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            described = tuple(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)
            name = func.__name__.split(".")[0]
            self.collectives.append(Collective(name, _group_ranks(args), described, caller()))
        return func(*args, **kwargs)


@dataclass(frozen=True)
class Disagreement:
    group: tuple[int, ...]
    position: int  # index among the group's collectives
    by_rank: dict[int, Collective | None]  # None: that rank issued no collective there (it stopped short)

    def __str__(self) -> str:
        lines = [f"ranks {_ranks_text(self.group)} disagree at their collective #{self.position} on that group:"]
        for rank, collective in self.by_rank.items():
            lines.append(f"  rank {rank}: {collective if collective is not None else 'nothing (it issued fewer)'}")
        return "\n".join(lines)


def first_disagreement(records: dict[int, list[Collective]]) -> Disagreement | None:
    """The first place where simulated ranks that share a group issue different collectives on it."""
    groups = {c.group for collectives in records.values() for c in collectives}
    for group in sorted(groups, key=lambda g: (-len(g), g)):
        members = {rank: [c for c in collectives if c.group == group]
                   for rank, collectives in records.items() if rank in group}
        if len(members) < 2:
            continue
        longest = max(len(sequence) for sequence in members.values())
        for position in range(longest):
            at = {rank: sequence[position] if position < len(sequence) else None for rank, sequence in members.items()}
            if len({c.signature if c is not None else None for c in at.values()}) > 1:
                return Disagreement(group, position, at)
    return None
