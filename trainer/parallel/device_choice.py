"""Which device a rank trains on (``parallel.device``), and why CUDA is not there when it is not.

``auto`` takes the GPU when CUDA starts and the CPU otherwise; ``cuda`` refuses to fall back.  The
cluster configs say ``cuda``: a CUDA 13 wheel on a node whose driver is too old makes
``torch.cuda.is_available()`` false, and under ``auto`` such a job would train for days on
CPU/gloo with the CPU JPEG decoder instead of stopping at once.

A rank always gets ``cuda:LOCAL_RANK``, the GPU DeepSpeed also picks from ``LOCAL_RANK``.  With
fewer visible GPUs than ranks on the node there is no right answer (two ranks would share a GPU,
or DeepSpeed and this code would disagree), so that is an error rather than a modulo.
"""

from __future__ import annotations

import ctypes
import os
import shutil

import torch

DEVICE_CHOICES = ("auto", "cuda", "cpu")


def choose_device(requested: str, local_rank: int, local_world_size: int | None = None) -> torch.device:
    """The device of the rank with ``local_rank`` among ``local_world_size`` ranks on its node."""
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"parallel.device={requested!r} is invalid: use one of {', '.join(DEVICE_CHOICES)}")
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if requested == "cuda":
            raise RuntimeError(
                f"parallel.device=cuda but CUDA cannot start on this node: {cuda_facts()}.  Fix: run on a node "
                "whose NVIDIA driver supports this CUDA version (or use an image whose torch wheel matches the "
                "driver), and give the pod its GPUs (nvidia.com/gpu); set parallel.device=cpu to train on CPU "
                "on purpose.")
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    ranks_here = max(local_world_size or 0, local_rank + 1)
    if ranks_here > visible:
        raise RuntimeError(
            f"local rank {local_rank}: {ranks_here} ranks run on this node but only {visible} GPU(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); each rank needs its "
            "own GPU (cuda:LOCAL_RANK, as DeepSpeed uses).  Fix: launch with --nproc-per-node equal to the "
            "GPUs per node (the pod's nvidia.com/gpu limit), or make that many GPUs visible.")
    return torch.device("cuda", local_rank)


def cuda_facts() -> str:
    """What torch sees of CUDA, readable without a working GPU."""
    facts = [f"torch {torch.__version__} built for CUDA {torch.version.cuda or 'none (CPU-only build)'}",
             f"torch.cuda.is_available()={torch.cuda.is_available()}",
             f"NVIDIA driver {driver_version()}"]
    if torch.version.cuda:
        try:
            torch.cuda.init()
        except Exception as error:  # noqa: BLE001 - its message is the reason (e.g. "driver too old")
            facts.append(f"CUDA said: {str(error).splitlines()[0]}")
    if shutil.which("nvidia-smi") is None:
        facts.append("nvidia-smi is not on PATH (no driver mounted into the container?)")
    return "; ".join(facts)


def driver_version() -> str:
    """The driver's CUDA version from libcuda itself: it answers without a GPU, unlike torch."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "not found (libcuda.so.1 cannot be loaded)"
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return "present but cuDriverGetVersion failed"
    return f"supports CUDA {version.value // 1000}.{version.value % 1000 // 10}"
