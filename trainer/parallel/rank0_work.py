"""Work that only rank 0 does while the other ranks wait for its result, with no collective deadline.

A collective gives up after its group's timeout.  Some work only rank 0 can do, on what was
gathered into its host memory: the linear probe's fits, writing the evaluation features out.  At
ImageNet scale the fits alone can outlast any timeout worth setting, and a rank that waited in
``broadcast_object_list`` meanwhile would raise after a finished run: the pod is retried, resumes
with nothing left to train, evaluates again and fails again.  So the other ranks wait on a key of
the job's store (the one every rank joined at ``init_process_group``): they poll it, one small
request at a time, with no deadline.  Only then do the ranks meet in a barrier, which each reaches
within a poll of the result, so that rank 0 (which may host the store) ends after the others have
read it.  If rank 0's work raises, rank 0 publishes the error before raising it, and the others
raise too; if rank 0 dies, the launcher stops every rank, as for any failed rank.
"""

from __future__ import annotations

import pickle
import time
from typing import Callable, TypeVar

import torch.distributed as dist

Result = TypeVar("Result")

KEY_PREFIX = "instcls/rank0_work"
FIRST_POLL_S = 0.01
MAX_POLL_S = 1.0  # a waiting rank asks the store at most this far apart


class Rank0WorkFailed(RuntimeError):
    """Rank 0's work raised; the other ranks raise this, naming its error."""


def run_on_rank0(work: Callable[[], Result], group, max_poll_s: float = MAX_POLL_S) -> Result:
    """``work()`` run on ``group``'s first rank, its result (small, picklable) returned on every rank
    of ``group``, which all call this together; the others never call ``work``.  ``group``: None in a
    single-process run."""
    if group is None or dist.get_world_size(group) == 1:
        return work()
    store = dist.distributed_c10d._get_default_store()
    name = f"{KEY_PREFIX}/{group.group_name}"
    # Every rank counts its own calls in the store: the n-th call of each rank shares the n-th key.
    key = f"{name}/{store.add(f'{name}/calls/rank{dist.get_rank()}', 1)}"
    failure = None
    if dist.get_rank(group) == 0:
        try:
            outcome = (True, work())
        except BaseException as error:  # noqa: B036 -- raised below, once the others have it
            failure, outcome = error, (False, f"{type(error).__name__}: {error}")
        store.set(key, pickle.dumps(outcome))
    else:
        delay = FIRST_POLL_S
        while not store.check([key]):
            time.sleep(delay)
            delay = min(2 * delay, max_poll_s)
        outcome = pickle.loads(store.get(key))
    dist.barrier(group=group)  # every rank has read the key: rank 0 may end (see the module docstring)
    if failure is not None:
        raise failure
    succeeded, value = outcome
    if not succeeded:
        raise Rank0WorkFailed(f"rank {dist.get_rank()}: the work it waited for failed on rank 0 ({value}); rank 0's "
                              "own error says more")
    return value
