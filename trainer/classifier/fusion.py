"""One pass per chunk for elementwise loss math: ``torch.compile`` (inductor) where it can run.

Eager PyTorch makes one pass over a ``[chunk, B]`` block per elementwise op, so a loss term built
from a dozen ops reads the chunk a dozen times.  Inductor fuses such a function into one loop that
reads each logit once: C++/OpenMP on CPUs, Triton on GPUs.  The function stays plain PyTorch, so
the eager call is the same code and serves as the fallback (and the reference in tests).

Compilation costs a few seconds per new shape (the last, shorter chunk adds one), cached on disk
under ``TORCHINDUCTOR_CACHE_DIR``.  When it cannot run (no C++ compiler, no Triton), the first call
logs why and the function runs eagerly from then on: slower, same numbers.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)


class Fused:
    """``fn`` compiled on first use when ``compiled``; eager otherwise or after a failed compile."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._compiled: Callable | None = None
        self.fell_back = False

    def __call__(self, *args, compiled: bool = True):
        if not compiled or self.fell_back:
            return self.fn(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=False)
        try:
            return self._compiled(*args)
        except Exception as error:  # noqa: BLE001 - any backend failure: same numbers, eagerly
            # Only compiler failures land here; an error of the math itself repeats eagerly below.
            self.fell_back = True
            log.warning("torch.compile of %s failed (%s: %s); running it eagerly from now on (same results, more "
                        "passes over memory)", self.fn.__qualname__, type(error).__name__, str(error).splitlines()[0])
            return self.fn(*args)


def fused(fn: Callable) -> Fused:
    return Fused(fn)
