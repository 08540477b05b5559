"""One rank's failure ends a sweep point on every rank at once.

A rank that runs out of memory in the middle of a step leaves its peers inside a collective it
will never join.  NCCL does not notice that the peer is gone: they wait for the process group's
timeout (120 s in the bench) at every failing point of a sweep.  A flag all-reduce cannot help,
since the peers are blocked in an earlier collective and never reach it.  So the ranks agree
through the rendezvous store instead: the failing rank writes why, and a watcher thread on every
rank, which runs while the main thread is blocked, sees it and ends that rank's part of the point.
The store lives in rank 0, which may finish and exit a moment before the others in a good point:
a store that stops answering therefore ends the watch, not the point.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Callable

import torch.distributed as dist

FAILED_KEY = "failed"
POLL_S = 0.2


class PointFailure:
    def __init__(self, rank: int, world_size: int, on_peer_failure: Callable[[str], None]) -> None:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=datetime.timedelta(seconds=30))
        self.store = dist.PrefixStore("instcls/bench-point", store)
        self.rank, self.on_peer_failure = rank, on_peer_failure
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="point-failure-watch", daemon=True).start()

    def report(self, message: str) -> None:
        """This rank failed: stop watching, tell the others and give their watchers time to read it
        (if this is rank 0, the store goes when this process does)."""
        self._done.set()
        try:
            self.store.set(FAILED_KEY, f"rank {self.rank}: {message}")
        except Exception:  # noqa: BLE001 - rank 0 (the store) is gone: nobody is left waiting on this rank
            return
        time.sleep(3 * POLL_S)

    def finished(self) -> None:
        """This rank's part of the point is over (its result is written): stop watching."""
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(POLL_S):
            try:
                failed = self.store.check([FAILED_KEY])
                reason = self.store.get(FAILED_KEY).decode() if failed else None
            except Exception:  # noqa: BLE001 - rank 0 (the store) has ended
                return
            if failed and not self._done.is_set():
                self._done.set()
                self.on_peer_failure(reason)
                return
