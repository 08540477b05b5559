"""`parallel.deterministic`: the same inputs give the same bits, on GPU hosts too.

A resumed run can only be compared with an uninterrupted one bit for bit (the drills, the resume
tests) when every kernel is deterministic.  On CPU ranks they are; on CUDA, cuDNN's autotuned
convolutions, cuBLAS's multi-stream workspaces and a few atomic-add kernels are not.  This turns
on torch's deterministic mode, which picks deterministic kernels and raises on an op that has
none (rather than silently differing), at some cost in speed, so it is off by default.
"""

from __future__ import annotations

import os

import torch

# cuBLAS is deterministic only with a fixed workspace per stream; torch refuses deterministic
# mode's cuBLAS calls without one.  It is read when cuBLAS initialises, so before any CUDA work.
CUBLAS_WORKSPACE = ":4096:8"


def apply_determinism(enabled: bool) -> None:
    """Call once per process, before the first CUDA op (before ``init_distributed``).

    Off, cuDNN autotunes each convolution shape once (``cudnn.benchmark``): the training step's
    shapes repeat, so the search pays for itself within a few steps."""
    if not enabled:
        torch.backends.cudnn.benchmark = True
        return
    # ":16:8" is the other value torch accepts; a user's own choice of either is kept.
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True, warn_only=False)
    # Autotuning picks the fastest convolution per run, not the same one.
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
