"""`python -m trainer.cli ...`: how torchrun, the deepspeed launcher and the drills start ranks.
Under `instcls launch` each rank also leaves its exit code for the launcher to read."""

import sys

from trainer.cli import main
from trainer.exit_codes import run_reporting_exit_code

sys.exit(run_reporting_exit_code(main))
