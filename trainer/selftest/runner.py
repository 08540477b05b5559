"""Run every self-test check on the devices this node has and collect one row each.

On a GPU node the checks run on the GPUs (NCCL across all visible ones, nvJPEG, Triton, a step of the
shipped job's DeepSpeed config); on a CPU-only machine the same code runs its CPU subset (gloo on
two ranks, DALI's CPU decoder, inductor's C++) and the GPU-only rows say they were skipped.  CI runs the CPU subset.
A node with NVIDIA devices whose CUDA cannot start is a failure, not a CPU machine.  The local
checks run on the *last* visible GPU, never the current device 0: code that forgets its device,
or touches GPU 0's context, fails there.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

import torch

from trainer.selftest import distributed_checks, local_checks
from trainer.selftest.report import FAIL, PASS, SKIPPED, CheckResult


def _guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    try:
        return check()
    except Exception as error:  # noqa: BLE001 - a failed check is a row of the table
        return CheckResult(name, FAIL, "", f"{type(error).__name__}: {error}")


def merge_ranks(by_rank: dict[int, list[CheckResult]], names: list[str]) -> list[CheckResult]:
    """One row per check over every rank: failed if it failed on any rank (named), skipped if every
    rank skipped it, not run where some rank stopped before it (an earlier check failed)."""
    merged = []
    for index, name in enumerate(names):
        rows = {rank: results[index] for rank, results in by_rank.items() if index < len(results)}
        missing = sorted(set(by_rank) - set(rows))
        failed = {rank: row for rank, row in rows.items() if row.status == FAIL}
        if failed:  # the first to fail: the others may only have lost it in a collective
            rank, row = min(failed.items(), key=lambda item: (item[1].at, item[0]))
            merged.append(CheckResult(name, FAIL, row.figure, f"rank {rank} of {len(by_rank)}: {row.detail}"))
        elif missing:
            merged.append(CheckResult(name, FAIL, "", f"not run on ranks {missing}: an earlier check failed there"))
        elif all(row.status == SKIPPED for row in rows.values()):
            merged.append(rows[min(rows)])
        else:
            first = rows[min(rows)]
            merged.append(CheckResult(name, PASS, first.figure, first.detail))
    return merged


def run_distributed(ranks: int, checks=None) -> list[CheckResult]:
    """The distributed checks on ``ranks`` spawned ranks, merged over the ranks."""
    from trainer.parallel.launch import spawn_local_workers

    checks = checks or distributed_checks.DISTRIBUTED_CHECKS
    with tempfile.TemporaryDirectory() as folder:
        spawn_local_workers(distributed_checks.worker, ranks, folder, checks)
        by_rank = {}
        for rank in range(ranks):
            path = Path(folder, f"rank-{rank}.json")
            by_rank[rank] = [CheckResult(**row) for row in json.loads(path.read_text())] if path.exists() else []
    return merge_ranks(by_rank, [distributed_checks.check_name(check) for check in checks])


def local_device() -> torch.device:
    """The last visible GPU (see the module docstring), or the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", torch.cuda.device_count() - 1)
    return torch.device("cpu")


# Looked up when run, so a check patched in local_checks is the one that runs.
LOCAL_CHECKS: tuple[tuple[str, Callable[[torch.device], CheckResult]], ...] = (
    ("devices", lambda device: local_checks.devices()),
    ("compiled CO2 kernel", lambda device: local_checks.compiled_co2(device)),
    ("PIC host store + prefetch", lambda device: local_checks.pic_host_store(device)),
    ("DALI decode", lambda device: local_checks.dali_decode(device)),
    ("host syncs per step", lambda device: local_checks.host_syncs_per_step(device)),
)


def check_names() -> list[str]:
    """Every row's name, in the order they run: the local checks, then the distributed ones."""
    return [name for name, _ in LOCAL_CHECKS] + [distributed_checks.check_name(check)
                                                 for check in distributed_checks.DISTRIBUTED_CHECKS]


def run_selftest(progress: Callable[[str], None] = print, only: list[str] | None = None) -> list[CheckResult]:
    """Every check, in order, or those named in ``only`` (``--only``: one path to look at again
    without the others' minutes); ``progress`` hears each row as it is done."""
    if unknown := sorted(set(only or ()) - set(check_names())):
        raise ValueError(f"--only {', '.join(map(repr, unknown))}: no such check; the checks are "
                         f"{', '.join(map(repr, check_names()))}")
    chosen = set(only or check_names())
    device = local_device()
    ranks = torch.cuda.device_count() if device.type == "cuda" else 2
    results = []
    for name, check in LOCAL_CHECKS:
        if name in chosen:
            results.append(_guarded(name, lambda check=check: check(device)))
            progress(f"{name}: {results[-1].status}")
    checks = tuple(check for check in distributed_checks.DISTRIBUTED_CHECKS
                   if distributed_checks.check_name(check) in chosen)
    if not checks:
        return results
    distributed = _guarded("distributed checks", lambda: run_distributed(ranks, checks))
    for row in distributed if isinstance(distributed, list) else [distributed]:
        results.append(row)
        progress(f"{row.name}: {row.status}")
    return results
