"""State that every rank must hold alike, checked across ranks at each save and evaluation.

A checkpoint keeps one copy of replicated state (rank 0's plain part on a change of world size;
``model.pt`` is rank 0's network), and an evaluation scores one network per rank.  State that each
rank updates on its own and that silently drifts apart therefore makes the saved job differ from
the one that ran.  What counts as replicated:

- the network: every parameter (below ZeRO-3, where each rank holds them whole) and every buffer,
  except, under ``model.batch_norm: local`` (or ``sync`` within nodes), each rank's own BatchNorm
  running statistics, whose average over the ranks (what is saved and scored,
  ``trainer.parallel.batch_norm``) is checked instead;
- every checkpoint component's plain state (the trainer's position, the sampler, the objective's
  counters, prototypes and recent-id queues) — everything except the rows wrapped in
  ``ShardedRows`` (each rank's own classifier rows, queue slices, hard-negative tables), the
  per-rank RNG streams and the per-rank BatchNorm statistics entry.

``diverged_entries`` hashes each entry exactly (sha256 of its bytes) and compares the digests over
the control group (gloo, host memory): one small all-gather at a save or an evaluation, never in
a training step.  The cost is one host copy of the network per check (~100 MB for ResNet-50).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Collection, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel import ParallelDims
from trainer.parallel.batch_norm import averaged_running_statistics
from trainer.parallel.sharded_state import ShardedRows

PER_RANK_COMPONENTS = ("rng", "batch_norm")  # RNG streams and local BatchNorm statistics differ by rank on purpose


def _digest(value) -> str:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1)
        payload = repr((str(value.dtype), tuple(value.shape))).encode() + data.view(torch.uint8).numpy().tobytes()
    elif isinstance(value, np.ndarray):
        payload = repr((str(value.dtype), value.shape)).encode() + np.ascontiguousarray(value).tobytes()
    else:
        payload = repr(value).encode()
    return hashlib.sha256(payload).hexdigest()


def _plain_leaves(value, path: str) -> Iterator[tuple[str, object]]:
    """``(path, leaf)`` of a state dict, leaving out row-sharded parts (each rank's own)."""
    if isinstance(value, ShardedRows):
        return
    if isinstance(value, Mapping):
        for key, child in value.items():
            yield from _plain_leaves(child, f"{path}.{key}")
    else:
        yield path, value


def replicated_digests(module: nn.Module, components: Mapping[str, object], parameters_whole: bool,
                       per_rank_buffers: Collection[str] = (), network: Mapping[str, torch.Tensor] | None = None
                       ) -> dict[str, str]:
    """``{name: digest}`` of everything every rank should hold alike.  ``module``: the network on this
    rank, less ``per_rank_buffers`` (each rank's own BatchNorm statistics under ``local``);
    ``parameters_whole``: its parameters are whole on every rank (not ZeRO-3 partitions);
    ``components``: the checkpoint's entries (those with a ``state_dict``); ``network``: what is
    saved and scored in place of the per-rank buffers (their average), which must agree."""
    digests = {f"model.{name}": _digest(buffer) for name, buffer in module.named_buffers()
               if name not in per_rank_buffers}
    digests.update({f"network.{name}": _digest(value) for name, value in (network or {}).items()})
    if parameters_whole:
        digests.update({f"model.{name}": _digest(parameter) for name, parameter in module.named_parameters()})
    for component_name, component in components.items():
        if component_name in PER_RANK_COMPONENTS or not hasattr(component, "state_dict"):
            continue
        for path, leaf in _plain_leaves(component.state_dict(), component_name):
            digests[path] = _digest(leaf)
    return digests


def diverged_entries(digests: dict[str, str], group: dist.ProcessGroup | None) -> list[str]:
    """Collective over ``group`` (a CPU group): the names whose digests are not the same on every rank
    (a name missing on some rank counts as diverged).  ``[]`` in a single process."""
    if group is None or dist.get_world_size(group) <= 1:
        return []
    every_rank: list[dict[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every_rank, digests, group=group)
    names = sorted(set().union(*every_rank))
    return [name for name in names if len({ranks.get(name) for ranks in every_rank}) > 1]


class OneNetwork:
    """Before every save and evaluation (``agree``, collective, once per step): where the ranks'
    BatchNorm running statistics differ (``averaged``: ``model.batch_norm: local``, or ``sync`` within
    nodes) they are averaged into the one
    network that is saved and scored (``statistics()``: what ``model.pt`` and the evaluation use in
    place of each rank's own); then everything each rank should hold alike is compared across ranks
    and the check is logged (``event: replicated``), any difference named in a warning."""

    def __init__(self, module: nn.Module, components: Mapping[str, object], averaged: bool, dims: ParallelDims,
                 parameters_whole: bool, log, say: Callable[[str], None]) -> None:
        self.module, self.components, self.dims = module, components, dims
        self.local = averaged  # the ranks' statistics differ (``statistics_differ_by_rank``)
        self.parameters_whole, self.log, self.say = parameters_whole, log, say
        self.step: int | None = None
        self._statistics: dict[str, torch.Tensor] | None = None

    def statistics(self) -> dict[str, torch.Tensor] | None:
        """The averaged statistics of the step last agreed on (None where every rank's own agree)."""
        return self._statistics

    def agree(self, step: int, moment: str) -> None:
        if self.step == step:  # a save and an evaluation at one step share one agreement
            return
        self.step = step
        spread = 0.0
        if self.local:
            self._statistics, spread = averaged_running_statistics(self.module, self.dims.data_parallel_group)
        per_rank = set(self._statistics or ())
        digests = replicated_digests(self.module, self.components, self.parameters_whole, per_rank, self._statistics)
        diverged = diverged_entries(digests, self.dims.control_group)
        self.log.write(event="replicated", moment=moment, step=step, batch_norm_spread=spread, entries=len(digests),
                       diverged=diverged)
        if diverged and self.dims.rank == 0:
            self.say(f"warning: {len(diverged)} entries that every rank should hold alike differ across ranks at step "
                     f"{step} ({', '.join(diverged[:5])}{'...' if len(diverged) > 5 else ''}); the checkpoint and "
                     "model.pt keep rank 0's. This is a bug: please report it with the logs")
