"""torch's op at one N under a per-rank memory cap: each of its settings timed in turn, the fastest
that fits kept (`bench ddp-vs-dhp`'s DDP baseline and `bench classifier --peer torch`).

The settings run in one set of fresh processes, the least memory first (``choices_in_memory_order``),
each with its own peak.  Under the CPU cap every large tensor is its own mapping and goes back to
the system when freed (``trainer.planning.memory_cap``), so a setting's peak is its own.  The first
allocation failure ends the point on every rank (``PointFailure``, as a DDP-vs-DHP point): the
settings after it need more memory, and are reported as not tried.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.bench.point_failure import PointFailure
from trainer.bench.torch_op import choices_in_memory_order
from trainer.bench.torch_op_steps import TorchOpSpec, run_torch_op_steps
from trainer.observability.memory import peak_since, reset_peak
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers
from trainer.planning.memory_cap import apply_memory_cap, is_out_of_memory

if TYPE_CHECKING:
    from trainer.bench.settings.ddp_vs_dhp import SweepSettings

GIB = 2**30
NOT_TRIED = "not tried"  # after a setting that needs less memory failed


def _spec(settings: SweepSettings, num_classes: int) -> TorchOpSpec:
    return TorchOpSpec(num_classes=num_classes, batch=settings.batch, dim=settings.dim, dtype=settings.dtype,
                       steps=settings.steps, warmup=settings.warmup)


def _worker(settings: SweepSettings, num_classes: int, result_dir: str) -> None:
    """Never raises (a failure is recorded, as in ``ddp_vs_dhp._point_worker``)."""
    dims = init_distributed(timeout_s=120)
    result_file = Path(result_dir, f"rank-{dims.rank:05d}.json")
    dtype = getattr(torch, settings.dtype)
    choices = choices_in_memory_order(settings.torch_settings, settings.batch // settings.ranks, num_classes,
                                      settings.dim, dtype, dims.device)
    runs: list[dict] = []

    def write() -> None:
        result_file.write_text(json.dumps(dict(rank=dims.rank, runs=runs)))

    def peer_failed(reason: str) -> None:  # on the watcher thread, while this rank waits in a collective
        runs.append(dict(setting=current.label, status="peer_failed", message=f"another rank failed: {reason}"))
        write()
        os._exit(0)

    watch = PointFailure(dims.rank, dims.world_size, peer_failed)
    current = choices[0]
    try:
        small = _spec(settings, max(16, settings.ranks))
        for current in choices:  # load what each setting's step touches before the measured peaks
            run_torch_op_steps(small, current, dims)
        apply_memory_cap(dims.device, int(settings.cap_gib * GIB))
        for current in choices:
            gc.collect()
            if dims.device.type == "cuda":
                torch.cuda.empty_cache()
            baseline = reset_peak(dims.device)
            stats = run_torch_op_steps(_spec(settings, num_classes), current, dims)
            peak, above = peak_since(dims.device, baseline)
            runs.append(dict(setting=current.label, status="ok", message="", step_s=stats.step_s, comm_s=stats.comm_s,
                             compute_s=stats.step_s - stats.comm_s, peak_bytes=peak, peak_above_baseline_bytes=above,
                             num_classes_local=stats.num_classes_local))
            write()
    except Exception as error:  # noqa: BLE001 - every failure becomes a recorded outcome
        oom = is_out_of_memory(error)
        runs.append(dict(setting=current.label, status="oom" if oom else "failed", message=str(error)[:300]))
        watch.report(("out of memory: " if oom else "") + str(error)[:200])
        write()
        os._exit(0)  # collectives this rank left half-done would block a process group teardown
    watch.finished()
    write()


def combine_ranks(labels: list[str], ranks: list[dict], world_size: int) -> list[dict]:
    """Per setting (in the order tried): its outcome over all ranks, and its per-rank figures when
    every rank ran it.  ``ok`` needs every rank's; any rank's allocation failure makes it ``oom``."""
    settings = []
    for label in labels:
        runs = [run for rank in ranks for run in rank["runs"] if run["setting"] == label]
        statuses = {run["status"] for run in runs}
        if not runs:
            status = NOT_TRIED
        elif statuses == {"ok"} and len(runs) == world_size:
            status = "ok"
        else:
            status = "oom" if "oom" in statuses else "failed"
        per_rank = [dict(run, rank=rank["rank"]) for rank in ranks for run in rank["runs"] if run["setting"] == label]
        settings.append(dict(setting=label, status=status, ranks=per_rank,
                             step_s=max(r["step_s"] for r in per_rank) if status == "ok" else None,
                             message=next((r["message"] for r in per_rank if r["message"]), "")))
    return settings


def fastest(settings: list[dict]) -> dict | None:
    """The setting with the smallest worst-rank step among those that fit, or None."""
    fits = [s for s in settings if s["status"] == "ok"]
    return min(fits, key=lambda s: s["step_s"]) if fits else None


def run_torch_point(settings: SweepSettings, num_classes: int) -> dict:
    """torch's op at ``num_classes`` on ``settings.ranks`` fresh processes, shaped like a DDP-vs-DHP
    point (``ranks``: the fastest setting's per-rank figures) plus ``torch_settings``, every setting's
    outcome in the order tried, and ``setting``, the fastest's name (None when none fits), with
    ``as_setting``, what gives it again (``resolve``)."""
    choices = choices_in_memory_order(settings.torch_settings, settings.batch // settings.ranks, num_classes,
                                      settings.dim, getattr(torch, settings.dtype), _device())
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.suppress(Exception):  # a rank killed outright leaves no file: its settings count as failed
            spawn_local_workers(_worker, settings.ranks, settings, num_classes, tmp)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank-*.json"))]
    outcomes = combine_ranks([c.label for c in choices], ranks, settings.ranks)
    for outcome, choice in zip(outcomes, choices):
        outcome["as_setting"] = choice.as_setting  # what resolves to it again (the agreement check's setting)
    best = fastest(outcomes)
    statuses = {s["status"] for s in outcomes}
    status = "ok" if best else ("oom" if "oom" in statuses else "failed")
    return dict(mode="ddp", num_classes=num_classes, status=status, setting=best and best["setting"],
                as_setting=best and best["as_setting"], ranks=best["ranks"] if best else [], torch_settings=outcomes)


def _device() -> torch.device:
    """The ranks' kind of device (what ``auto`` is resolved for)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
