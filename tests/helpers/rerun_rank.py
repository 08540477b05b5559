"""A worker for `instcls launch` tests of torchrun's second round: in round 0 rank 1 stops as a
SIGTERM'd rank does (it reports 143) and rank 0 crashes; in round 1 rank 1 is killed before its
first line (no report of its own) and rank 0 crashes again."""

import os
import signal
import sys

from trainer.exit_codes import ExitCode, run_reporting_exit_code

if __name__ == "__main__":
    rank, first_round = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rank == "1" and not first_round:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would, while the worker starts
    sys.exit(run_reporting_exit_code(lambda: ExitCode.PREEMPTED if rank == "1" else ExitCode.CRASHED))
