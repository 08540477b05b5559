"""`instcls launch ARGS...`: torchrun with Kubernetes-friendly exit codes.

torchrun forwards SIGTERM to its workers, but then re-raises it and exits 1 even when every worker
saved a checkpoint and exited 0, and Kubernetes records the main process's code.  This wrapper
runs ``python -m torch.distributed.run ARGS...`` as a child, forwards SIGTERM/SIGINT to it, and
exits 0 if the workers reported a completed preemption save (they write a marker into
``INSTCLS_STOP_MARKER_DIR`` after the collective save finishes), else torchrun's own code.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

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
