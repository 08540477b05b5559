"""Start T local worker processes that look exactly like a ``torchrun`` job to the code they run.

Used by the benchmarks (``instcls bench`` spawns its own ranks) and by the multi-rank tests.  Each
worker gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, an even share of the CPU
cores, and its process group is destroyed when the function returns.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from trainer.parallel.dims import shutdown_distributed


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(local_rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if not torch.cuda.is_available():
        # T ranks share the machine's cores; oversubscribing them makes every rank slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        fn(*args)
    finally:
        shutdown_distributed()


def spawn_local_workers(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(*args)`` in ``world_size`` fresh processes and wait for all of them.

    ``fn`` must be importable (a module-level function).  An exception in any worker is re-raised
    here with that worker's traceback.
    """
    mp.start_processes(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, start_method="spawn")
