"""``instcls launch`` stops torchrun at the first failure that a restart cannot heal.

torchrun restarts its workers after any non-zero exit, up to ``--max-restarts`` (the elastic
overlays allow 100, for lost nodes).  A bad input (exit 2), a non-finite model (3) or a checkpoint
that cannot be written (4) fails every restart the same way, so the GPUs would sit through a
hundred rounds of rendezvous, start-up and failure before the Job's rule for the code could fire.
``HopelessFailureWatch`` reads the ranks' exit reports as they are written
(``trainer.exit_codes.run_reporting_exit_code``: each rank's before it exits), of every round (torchrun
may have begun the next round before it looks; a code no restart heals is final whichever round wrote
it) and, at the first permanent code, says which rank and why, and stops torchrun with SIGTERM, which
ends its workers without another round.  Crashes (1), lost peers and preemption keep torchrun's restarts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from trainer.exit_codes import PERMANENT, ExitCode, first_failure, reported_exit_codes
from trainer.parallel.background_watch import BackgroundWatch


class HopelessFailureWatch(BackgroundWatch):
    """While the block runs, watch ``reports`` every ``every_s`` seconds; ``stopped_for``: the code that
    made it stop ``child`` (None: it did not)."""

    thread_name = "hopeless-failure-watch"

    def __init__(self, reports: Path, child: subprocess.Popen, every_s: float = 0.1, write=None) -> None:
        super().__init__()
        self.reports, self.child, self.every_s = reports, child, every_s
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.stopped_for: int | None = None

    def _watch(self) -> None:
        while not self._done.wait(self.every_s):
            permanent = sorted(code for code in reported_exit_codes(self.reports, every_round=True)
                               if code in PERMANENT)
            if permanent:
                self._stop(permanent[0])
                return

    def _stop(self, code: int) -> None:
        self.stopped_for = code
        rank, cause = first_failure(self.reports, every_round=True, codes={code}) or ("?", "")
        self.write(f"instcls launch: rank {rank} exited {code} ({ExitCode(code).name}): {cause}. A restart cannot heal "
                   "this, so torchrun is stopped now instead of restarting the workers")
        if self.child.poll() is None:
            self.child.terminate()
