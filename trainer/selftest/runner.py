"""Run every self-test check on the devices this node has and collect one row each.

On a GPU node the checks run on the GPUs (NCCL across all visible ones, nvJPEG, Triton, bf16
ZeRO-2); on a CPU-only machine the same code runs its CPU subset (gloo on two ranks, DALI's CPU
decoder, inductor's C++) and the GPU-only rows say they were skipped.  CI runs the CPU subset.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

import torch

from trainer.selftest import distributed_checks, local_checks
from trainer.selftest.report import FAIL, CheckResult


def _guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    try:
        return check()
    except Exception as error:  # noqa: BLE001 - a failed check is a row of the table
        return CheckResult(name, FAIL, "", f"{type(error).__name__}: {error}")


def _distributed(ranks: int) -> list[CheckResult]:
    from trainer.parallel.launch import spawn_local_workers

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "results.json"
        spawn_local_workers(distributed_checks.worker, ranks, str(path))
        return [CheckResult(**row) for row in json.loads(path.read_text())]


def run_selftest(progress: Callable[[str], None] = print) -> list[CheckResult]:
    """Every check, in order; ``progress`` hears each row as it is done."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    ranks = torch.cuda.device_count() if device.type == "cuda" else 2
    checks = [
        ("devices", local_checks.devices),
        ("compiled CO2 kernel", lambda: local_checks.compiled_co2(device)),
        ("PIC host store + prefetch", lambda: local_checks.pic_host_store(device)),
        ("DALI decode", lambda: local_checks.dali_decode(device)),
        ("host syncs per step", lambda: local_checks.host_syncs_per_step(device)),
    ]
    results = []
    for name, check in checks:
        results.append(_guarded(name, check))
        progress(f"{name}: {results[-1].status}")
    distributed = _guarded("distributed checks", lambda: _distributed(ranks))
    for row in distributed if isinstance(distributed, list) else [distributed]:
        results.append(row)
        progress(f"{row.name}: {row.status}")
    return results
