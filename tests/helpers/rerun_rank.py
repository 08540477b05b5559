"""A worker for `instcls launch` tests of torchrun's second round: in round 0 rank 1 stops as a
SIGTERM'd rank does (it reports 143) and rank 0 crashes; in round 1 rank 1 is killed before its
first line (no report of its own) and rank 0 crashes again."""

import os
import signal
import sys
import time

from trainer.exit_codes import ExitCode, run_reporting_exit_code

if __name__ == "__main__":
    rank, first_round = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rank == "1" and not first_round:
        # Killed before it reports, after rank 0 has reported its crash: dying at once let torchrun tear
        # rank 0 down before its report on a loaded machine.  torchrun stops this rank (SIGTERM, no
        # handler here: no report) once rank 0 exits; the SIGKILL, as the OOM killer's, is the backstop.
        time.sleep(30)
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(run_reporting_exit_code(lambda: ExitCode.PREEMPTED if rank == "1" else ExitCode.CRASHED))
