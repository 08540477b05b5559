"""What `instcls launch` says on its own: while torchrun waits silently for the other nodes, and,
when the job failed, the one line that says why, printed last (after torchrun's report and every
peer's traceback, which are about the failure's consequences, not its cause)."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trainer.exit_codes import any_rank_started, first_failure
from trainer.parallel.background_watch import BackgroundWatch

NOTICE_ENV = "INSTCLS_RENDEZVOUS_NOTICE_S"  # seconds between "still waiting" lines (default 30)


def rendezvous_description(torchrun_args: list[str]) -> str:
    """Where and for how many nodes torchrun's rendezvous waits, from its own argument parser."""
    from torch.distributed.run import get_args_parser

    try:
        args = get_args_parser().parse_args(torchrun_args)
    except SystemExit:  # torchrun will print its own usage error
        return "torchrun's rendezvous"
    if args.standalone:
        return "a single-node rendezvous (--standalone)"
    endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or 29500}"
    nodes = args.nnodes.split(":")[-1]
    timeout = next((item.split("=", 1)[1] for item in args.rdzv_conf.split(",") if item.startswith("join_timeout=")),
                   "600")
    return (f"{nodes} node(s) (--nnodes {args.nnodes}) at {endpoint} ({args.rdzv_backend}); this node "
            f"({socket.gethostname()}, --node-rank {args.node_rank}) has joined. Start the other nodes with the "
            f"same rendezvous, or fix --nnodes; torchrun gives up after join_timeout={timeout} s")


class RendezvousNotice(BackgroundWatch):
    """Prints a line every ``every_s`` seconds until a worker of this node has started."""

    thread_name = "rendezvous-notice"

    def __init__(self, reports: Path, description: str | Callable[[], str], every_s: float | None = None,
                 write=None) -> None:
        """``description``: or a function that makes it, called at the first line only: torchrun's own
        parser imports torch, which a launch whose rendezvous completes at once never pays."""
        super().__init__()
        self.reports, self.description = reports, description
        self.every_s = float(os.environ.get(NOTICE_ENV, "30")) if every_s is None else every_s
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))

    def _watch(self) -> None:
        started = time.monotonic()
        while not self._done.wait(self.every_s):
            if any_rank_started(self.reports):
                return
            if callable(self.description):
                self.description = self.description()
            self.write(f"instcls launch: waited {time.monotonic() - started:.0f} s for the rendezvous of "
                       f"{self.description}")


def failure_cause_line(reports: Path) -> str | None:
    """The job's last line when it failed: the first failed rank on this node and its own words."""
    found = first_failure(reports)
    if found is None:
        return None
    rank, cause = found
    return f"instcls launch: the first rank to fail on this node was rank {rank}: {cause}"
