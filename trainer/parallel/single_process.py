"""`instcls train` typed without a launcher: a job of one process, not a DeepSpeed traceback.

DeepSpeed needs a process group even for one rank, and torchrun is what normally describes it
(RANK, WORLD_SIZE, MASTER_ADDR, ...).  Without any of that, the command describes a one-rank job on
this machine itself and says how to run more ranks.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from trainer.parallel.launch import free_port

LAUNCH_HINT = ("for several GPUs or CPU ranks run `instcls launch --nproc-per-node N -m trainer.cli train ...` "
               "(torchrun's arguments)")


def describe_single_process_job(environ=os.environ) -> str | None:
    """Fill in torchrun's variables for one local rank when no launcher set them; returns the line
    to tell the user, or None when a launcher did (or the user set WORLD_SIZE by hand)."""
    if "WORLD_SIZE" in environ:
        return None
    environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return f"no launcher set WORLD_SIZE: training as one process on this machine; {LAUNCH_HINT}"


@contextmanager
def single_process_job(environ=os.environ) -> Iterator[str | None]:
    """``describe_single_process_job`` for the length of one job (its line, or None).  The variables
    it filled in are removed when the job ends, so that the next job of the same process (a
    notebook's next ``trainer.train``) gets a free port of its own; a launcher's are left alone."""
    before = set(environ)
    line = describe_single_process_job(environ)
    filled_in = set(environ) - before
    try:
        yield line
    finally:
        for name in filled_in:
            environ.pop(name, None)
