"""A worker for `instcls launch` tests: rank 1 fails with a bad input (exit 2) shortly after it
starts, as a rank refusing its config would; the other ranks keep running, as peers in the middle of
training.  Each start appends ``RANK RESTART_COUNT`` to ``$HOPELESS_STARTS`` so a test can count
torchrun's rounds."""

import os
import sys
import time
from pathlib import Path

from trainer.exit_codes import ExitCode, record_failure_cause, run_reporting_exit_code


def main() -> int:
    rank = os.environ["RANK"]
    with Path(os.environ["HOPELESS_STARTS"]).open("a") as starts:
        starts.write(f"{rank} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n")
    if rank == "1":
        time.sleep(0.5)
        line = "instcls: error: data.train_shards=/nowhere has no shards (a bad input on rank 1)"
        print(line, file=sys.stderr, flush=True)
        record_failure_cause(line)
        return ExitCode.BAD_INPUT
    time.sleep(120)
    return ExitCode.FINISHED


if __name__ == "__main__":
    sys.exit(run_reporting_exit_code(main))
