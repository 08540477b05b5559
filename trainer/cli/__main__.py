"""`python -m trainer.cli ...`: how torchrun, the deepspeed launcher and the drills start ranks."""

import sys

from trainer.cli import main

sys.exit(main())
