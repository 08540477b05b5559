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

Compilation costs a few seconds per new signature (the last, shorter chunk adds one).  Inductor's
FX graph cache keeps each compiled graph on disk under ``TORCHINDUCTOR_CACHE_DIR``: another process
with the same signature (the job's other ranks, a restarted pod with the cache on a volume) loads
it in a fraction of a second instead of generating its code again.  ``Fused.prepare`` compiles
ahead of the first call: a function the backward runs is prepared during the forward, so inductor
never compiles inside the backward (on CUDA that is autograd's own thread, mid-step).

When compiling fails on a CPU rank (no C++ compiler), the first call logs why and the function runs
eagerly from then on: slower, same numbers.  On an accelerator the failure is an error: the eager
function reads each chunk ~25 times, a silent 5-10x slowdown of the step; setting
``INSTCLS_FUSION_EAGER_FALLBACK=1`` accepts the fallback there too.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable

import torch
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

log = logging.getLogger(__name__)

EAGER_FALLBACK_ENV = "INSTCLS_FUSION_EAGER_FALLBACK"


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
        # On fake copies of the inputs: a "real" trace would run the eager function on the chunk,
        # its ~25 chunk-sized temporaries alive at once (12 GiB at ImageNet-21K's chunk shape).
        graph = make_fx(on_tensors, tracing_mode="fake")(*example)
        # Inductor keys its FX graph cache on the tracing context's shape environment and bypasses the
        # cache without one (as a bare `torch._inductor.compile` has): the context makes a later
        # process (another rank, the next pod) load the compiled graph instead of generating it again.
        with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):
            return torch._inductor.compile(graph, example)


def _on_accelerator(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)


def _shapes(args: tuple) -> str:
    return ", ".join("x".join(map(str, a.shape)) for a in args if isinstance(a, torch.Tensor))


def _say(message: str) -> None:
    """A compile can take tens of seconds: said once per node (local rank 0), not silently waited for."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"[instcls] {message}", file=sys.stderr, flush=True)


class FusionCompileError(RuntimeError):
    """Inductor could not compile a fused function on an accelerator (and no fallback was allowed)."""


class Fused:
    """``fn`` compiled per signature on first use (or at ``prepare``) when ``compiled``; eager
    otherwise or after a failed compile on a CPU rank.  ``fn`` must not modify its inputs (the traced
    graph is functional): it returns its results."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._kernels: dict[tuple, Callable] = {}
        self.fell_back = False

    def prepare(self, *args, compiled: bool = True) -> None:
        """Compile for arguments like ``args`` now, so that a later call with the same signature
        (shapes, strides, dtypes, devices, other values) only runs the kernel."""
        if compiled and not self.fell_back:
            self._kernel(args)

    def __call__(self, *args, compiled: bool = True):
        if not compiled or self.fell_back:
            return self.fn(*args)
        kernel = self._kernel(args)
        if kernel is None:
            return self.fn(*args)
        try:
            return kernel(*(a for a in args if isinstance(a, torch.Tensor)))
        except Exception as error:  # noqa: BLE001 - a backend failure at its first run (e.g. a kernel load)
            # Only compiler failures land here; an error of the math itself repeats eagerly below.
            self._fall_back(args, error)
            return self.fn(*args)

    def _kernel(self, args: tuple) -> Callable | None:
        """The compiled kernel for ``args``' signature, compiled now if new; None after a fallback."""
        key = _signature(args)
        kernel = self._kernels.get(key)
        if kernel is None:
            try:
                started = time.perf_counter()
                _say(f"compiling {self.fn.__qualname__} with inductor for {_shapes(args)} (first use of these shapes)")
                kernel = self._kernels[key] = compile_for(self.fn, args)
                _say(f"compiled {self.fn.__qualname__} in {time.perf_counter() - started:.1f} s")
            except Exception as error:  # noqa: BLE001 - any backend failure: same numbers, eagerly
                self._fall_back(args, error)
                return None
        return kernel

    def _fall_back(self, args: tuple, error: Exception) -> None:
        reason = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        if _on_accelerator(args) and os.environ.get(EAGER_FALLBACK_ENV) != "1":
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            raise FusionCompileError(
                f"inductor could not compile {self.fn.__qualname__} on {device} ({reason}); running it eagerly "
                "would make ~25 passes over each chunk (a 5-10x slower step). "
                f"Fix the Triton/inductor install, or set {EAGER_FALLBACK_ENV}=1 to run eagerly anyway"
            ) from error
        self.fell_back = True
        log.warning(
            "inductor could not compile %s (%s); running it eagerly from now on (same results, more passes "
            "over memory)",
            self.fn.__qualname__,
            reason,
        )


def fused(fn: Callable) -> Fused:
    return Fused(fn)
