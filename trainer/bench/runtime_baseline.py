"""A CPU rank's memory before it holds any tensor: Python, torch, DeepSpeed, DALI and the trainer's
own modules, measured in a fresh process that imports what a training rank imports.

About 1.1 GiB here, whatever N is: on a CPU rank it stands beside the planned tensors in the same
memory, so `instcls plan --cpu` shows it as a line of its own.  Measured, not assumed: it depends on
the libraries' builds (a CUDA build of torch maps its CUDA libraries even on a CPU-only machine).
"""

from __future__ import annotations

import subprocess
import sys
from functools import lru_cache

_IMPORTS = """
import trainer.engine.training_job  # torch, DeepSpeed, the trainer's library
if {dali}:
    try:
        import data_pipeline.loading.dali_loader  # DALI, when the job's loader is DALI's
    except ImportError:
        pass
with open("/proc/self/status") as status:
    print(next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:")))
"""


@lru_cache(maxsize=2)
def runtime_rss_bytes(dali: bool) -> int:
    """The resident memory of a fresh Python process once it imported what a CPU training rank
    imports (``dali``: the DALI loader too).  Takes the seconds those imports take."""
    result = subprocess.run([sys.executable, "-c", _IMPORTS.format(dali=dali)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"measuring the runtime's memory failed: {result.stderr.strip()[-2000:]}")
    return int(result.stdout.split()[-1])
