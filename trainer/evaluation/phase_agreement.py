"""The ranks of a frozen-feature evaluation agree at the end of each of its phases whether every rank
got through it, so that one rank's error ends the evaluation on every rank at once.

Without it, a rank whose evaluation raises between two collectives goes its own way (the end-of-run
evaluation's failure is logged and the rank exits) while the others wait in the next collective:
under NCCL until the group's timeout (600 s), waiting for rank 0's work (``run_on_rank0``) with no
deadline at all.  The launcher then restarts the job, which evaluates again.

So each phase's work runs through ``EvaluationPhases.run``: its error, if any, is kept, and every
rank then takes part in one all-reduce of a "failed" flag (4 bytes on the gloo control group: no
device sync).  When a rank failed, the ranks exchange their causes and every rank raises: a failing
rank its own error, the others ``EvaluationAbandoned``, naming the rank, the phase and the cause.

Phases end where work that one rank may fail alone ends (reading and decoding shards, forward
passes, host copies, rank 0's fits), before the next collective.  What this does not cover: a rank
failing between two collectives *inside* a phase (an out-of-memory error between two rounds of the
sharded kNN) still leaves the others waiting in the phase's next collective; an error raised by a
collective itself is raised on every rank anyway.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from trainer.failpoints import armed

Result = TypeVar("Result")


class EvaluationAbandoned(RuntimeError):
    """Another rank's evaluation failed; this rank stops its own at the same phase boundary."""


class EvaluationPhases:
    """The phase boundaries of one evaluation, on ``group`` (the control group; None in a
    single-process run, where an error is simply raised).  ``fail_point``: a fail point
    (``trainer.failpoints``) that, where armed, makes the phase ``fail_at`` fail once its work
    is done, just before its boundary."""

    def __init__(self, group, fail_point: str | None = None, fail_at: str | None = None) -> None:
        self.group, self.fail_point, self.fail_at = group, fail_point, fail_at

    def run(self, phase: str, work: Callable[[], Result]) -> Result:
        """Collective: ``work()``'s result once every rank has finished ``phase``; raises on every
        rank when ``work`` raised on any."""
        result = error = None
        try:
            result = work()
            if self.fail_point is not None and phase == self.fail_at and armed(self.fail_point):
                raise RuntimeError(f"fail point {self.fail_point}: the evaluation failed on purpose after its "
                                   f"{phase} phase")
        except Exception as caught:  # noqa: BLE001 - agreed on by every rank below, then raised
            error = caught
        self._agree(phase, error)
        return result

    def _agree(self, phase: str, error: Exception | None) -> None:
        if self.group is not None and dist.get_world_size(self.group) > 1:
            failed = torch.tensor([int(error is not None)], dtype=torch.int32)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
            if failed.item():
                cause = None if error is None else f"{type(error).__name__}: {error}"
                causes: list[str | None] = [None] * dist.get_world_size(self.group)
                dist.all_gather_object(causes, cause, group=self.group)
                if error is None:
                    first = next(index for index, found in enumerate(causes) if found is not None)
                    raise EvaluationAbandoned(
                        f"rank {dist.get_global_rank(self.group, first)}'s evaluation failed in its {phase} phase "
                        f"({causes[first]}); every rank stopped there")
        if error is not None:
            raise error
