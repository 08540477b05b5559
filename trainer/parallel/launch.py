"""Starting ranks: the container's entry point (``instcls launch``) and local worker processes.

``launch``: torchrun forwards SIGTERM to its workers, but then re-raises it and exits 1 even when
every worker saved a checkpoint and exited 0, and Kubernetes records the main process's code.  So
``instcls launch ARGS...`` runs ``python -m torch.distributed.run ARGS...`` as a child, forwards
SIGTERM/SIGINT to it, and exits 0 if the workers reported a completed preemption save (they write
a marker into ``INSTCLS_STOP_MARKER_DIR`` after the collective save finishes), else torchrun's code.

``spawn_local_workers``: T local processes that look exactly like a torchrun job to the code they
run; used by the benchmarks (``instcls bench`` spawns its own ranks) and the multi-rank tests.
Each worker gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, an even share of the
CPU cores, and its process group is destroyed when the function returns.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from trainer.parallel.dims import shutdown_distributed

MARKER_ENV = "INSTCLS_STOP_MARKER_DIR"


def mark_clean_stop(rank: int) -> None:
    """Called by a worker after its preemption checkpoint is complete."""
    directory = os.environ.get(MARKER_ENV)
    if directory:
        (Path(directory) / f"rank-{rank:05d}").touch()


def launch(torchrun_args: list[str]) -> int:
    marker_dir = Path(tempfile.mkdtemp(prefix="instcls-stop-"))
    child = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *torchrun_args],
                             env=dict(os.environ, **{MARKER_ENV: str(marker_dir)}))
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    returncode = child.wait()
    saved = any(marker_dir.iterdir())
    shutil.rmtree(marker_dir, ignore_errors=True)
    if received and saved:
        print("instcls launch: preempted; the workers saved a complete checkpoint, exiting 0", flush=True)
        return 0
    return returncode


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
    # The work is done and reported; skip the interpreter's teardown, where third-party C++ threads
    # (DeepSpeed ZeRO-3 on CPU) have been seen to abort ("terminate called without an active
    # exception") and turn a finished, correct run into a failed one.  Failures raised above still
    # reach the parent through torch.multiprocessing as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_local_workers(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(*args)`` in ``world_size`` fresh processes and wait for all of them.

    ``fn`` must be importable (a module-level function).  An exception in any worker is re-raised
    here with that worker's traceback.
    """
    mp.start_processes(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, start_method="spawn")
