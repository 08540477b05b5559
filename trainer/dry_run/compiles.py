"""Inductor compilations a step asks for, recorded, with the traced graph run in place of the kernel.

The classifier's fused loss terms (``trainer.classifier.terms.inductor_fusion``) are traced with
``make_fx`` and compiled by inductor once per input signature.  Inductor's Triton code generation
asks the driver for the GPU's properties, so on fake devices the dry run keeps the trace and, in
place of the kernel, allocates the kernel's outputs: a fused kernel holds nothing else, so the
memory counted is a kernel's.  The trace and the graph's run (to learn the outputs' shapes) happen
with the recorders off: a real trace runs on fake copies and allocates no device memory.
What it records is the point: a signature compiled after the first step is a recompilation that
the real job would pay in every such step (seconds each, and a kernel cache that only grows).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import torch
from torch._guards import detect_fake_mode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from trainer.dry_run.host_syncs import caller


def _outputs_only(graph):
    """A stand-in kernel: the graph's outputs, freshly allocated, none of its intermediates."""
    def kernel(*tensors):
        # The fake mode only: nothing counted.  ``forward``, not ``graph(...)``: a module call would
        # reach the memory tracker's global module hooks, which refuse a module run twice in a step.
        with _disable_current_modes(), detect_fake_mode(tensors):
            outputs = graph.forward(*tensors)
        return tree_map(lambda v: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                        if isinstance(v, torch.Tensor) else v, outputs)
    return kernel


@dataclass(frozen=True)
class Compilation:
    function: str
    shapes: str  # "4096x8192, 4096" per tensor argument
    where: str

    def __str__(self) -> str:
        return f"{self.function} for {self.shapes} at {self.where}"


class CompileRecorder:
    def __init__(self) -> None:
        self.compilations: list[Compilation] = []

    @contextlib.contextmanager
    def recording(self):
        from trainer.classifier.terms import inductor_fusion

        original = inductor_fusion.compile_for

        def traced_only(fn, args):
            self.compilations.append(Compilation(fn.__qualname__, inductor_fusion._shapes(args),
                                                 caller((inductor_fusion.__file__,))))
            with _disable_current_modes():
                return _outputs_only(original(fn, args))

        with (mock.patch.object(inductor_fusion, "compile_for", traced_only),
              mock.patch("torch._inductor.compile", lambda graph, example_inputs: graph)):
            yield self
