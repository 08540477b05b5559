"""The one line each rank writes at start: where it runs and with which versions.

A job that silently fell back to CPU/gloo, or a node with a different NCCL, is then visible in
the first lines of every rank's log instead of in a throughput graph days later.
"""

from __future__ import annotations

import torch


def _version(read) -> str:
    try:
        return str(read())
    except Exception:  # noqa: BLE001 - a missing library is reported, not fatal
        return "absent"


def _nccl() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _dali() -> str:
    import nvidia.dali

    return nvidia.dali.__version__


def _deepspeed() -> str:
    from trainer.parallel.deepspeed_import import deepspeed

    return deepspeed.__version__


def what_runs(dims) -> dict[str, object]:
    """Backend, device, ranks and library versions of this rank (``dims``: a ``ParallelDims``)."""
    return dict(backend=dims.backend or "none (single process)", device=str(dims.device), rank=dims.rank,
                world_size=dims.world_size, local_rank=dims.local_rank, torch=torch.__version__,
                cuda=torch.version.cuda or "none", cuda_available=torch.cuda.is_available(),
                nccl=_version(_nccl) if torch.version.cuda else "none", dali=_version(_dali),
                deepspeed=_version(_deepspeed))


def what_runs_line(facts: dict[str, object]) -> str:
    return (f"rank {facts['rank']}/{facts['world_size']} (local {facts['local_rank']}): backend {facts['backend']}, "
            f"device {facts['device']}; torch {facts['torch']}, CUDA {facts['cuda']} "
            f"(available: {facts['cuda_available']}), NCCL {facts['nccl']}, DALI {facts['dali']}, "
            f"DeepSpeed {facts['deepspeed']}")
