"""One pass per chunk for elementwise loss math: inductor where it can run.

Eager PyTorch makes one pass over a ``[chunk, B]`` block per elementwise op, so a loss term built
from a dozen ops reads the chunk a dozen times.  Inductor fuses such a function into one loop that
reads each logit once: C++/OpenMP on CPUs, Triton on GPUs.  The function stays plain PyTorch, so
the eager call is the same code and serves as the fallback (and the reference in tests).

The function is traced once per input signature (``make_fx``) and the graph handed to inductor
directly (``torch._inductor.compile``), not through ``torch.compile``: a chunk loop calls it
hundreds of times per step, and with dynamo's frame evaluation and guards a call cost 49 us against
9 us here.  Without dynamo nothing guards the inputs, so compiled kernels are kept per signature
(shapes, strides, dtypes, devices of the tensors; the values of every other argument, which are
baked into the graph and must be hashable).

Compilation costs a few seconds per new signature (the last, shorter chunk adds one), cached on
disk under ``TORCHINDUCTOR_CACHE_DIR``.  When it cannot run (no C++ compiler, no Triton), the first
call logs why and the function runs eagerly from then on: slower, same numbers.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

log = logging.getLogger(__name__)


def _signature(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args)


def compile_for(fn: Callable, args: tuple) -> Callable:
    """``fn`` compiled for arguments like ``args``; the compiled callable takes the tensors only."""
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    constants = [None if isinstance(a, torch.Tensor) else a for a in args]

    def on_tensors(*tensors):
        full = list(constants)
        for position, tensor in zip(positions, tensors):
            full[position] = tensor
        return fn(*full)

    example = [args[i] for i in positions]
    with torch.no_grad():
        graph = make_fx(on_tensors)(*example)
        return torch._inductor.compile(graph, example)


class Fused:
    """``fn`` compiled per signature on first use when ``compiled``; eager otherwise or after a
    failed compile.  ``fn`` must not modify its inputs (the traced graph is functional): it returns
    its results."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._kernels: dict[tuple, Callable] = {}
        self.fell_back = False

    def __call__(self, *args, compiled: bool = True):
        if not compiled or self.fell_back:
            return self.fn(*args)
        key = _signature(args)
        try:
            kernel = self._kernels.get(key)
            if kernel is None:
                kernel = self._kernels[key] = compile_for(self.fn, args)
            return kernel(*(a for a in args if isinstance(a, torch.Tensor)))
        except Exception as error:  # noqa: BLE001 - any backend failure: same numbers, eagerly
            # Only compiler failures land here; an error of the math itself repeats eagerly below.
            self.fell_back = True
            log.warning("inductor could not compile %s (%s: %s); running it eagerly from now on (same results, more "
                        "passes over memory)", self.fn.__qualname__, type(error).__name__, str(error).splitlines()[0])
            return self.fn(*args)


def fused(fn: Callable) -> Fused:
    return Fused(fn)
