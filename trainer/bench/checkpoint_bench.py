"""`instcls bench checkpoint`: what a checkpoint costs a 64-GPU job, per rank, through the real code.

Each of ``ranks`` local processes holds one job rank's share of a job of ``job_ranks`` ranks, for
each N in ``datasets`` (a column each): its classifier rows (N / job_ranks rows of W and momentum,
fp32, D wide, on the training device) as a row-sharded component, its ZeRO partition of the
backbone (``backbone_params`` / job_ranks fp32 values per copy: the master weight and
``optimizer_states`` moments) as DeepSpeed's per-rank file, and on rank 0 the consolidated
``model.pt`` and ``optimizer.pt`` the engine entry writes (``trainer.checkpoint.engine_state``), plus
the RNG and the trainer's position.  The tensors are synthetic (each row's values follow from its
index, so every load is checked exactly); everything else is ``AsyncCheckpointer`` and
``load_checkpoint`` as training uses them.  Not measured: the gather that builds rank 0's
consolidated files from the partitions (communication), and cold reads (the loads read what the
saves just wrote, from the page cache).

Reported per column, each the median of ``saves`` and the slowest rank's: the synchronous
(blocking) save, the step's stall with an asynchronous save (the snapshot; the first one, which
allocates the host buffers, apart), the background write, the load on the same ranks and the load
onto ``reshard_ranks`` ranks.  A preemption save may find a save in flight: it waits for it, then
saves blocking, so its worst case is one background write plus one synchronous save.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.bench.checkpoint_bench_state import bench_state, check_loaded
from trainer.bench.dataset_sizes import IMAGENET_1K, IMAGENET_21K
from trainer.bench.settings.checkpoint import CheckpointBenchSettings

MB = 1e6


def _slowest(seconds: float, dims) -> float:
    """The slowest rank's time (a save or load is done when every rank is)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    if dims.is_distributed:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=dims.control_group)
    return float(value.item())


def _time_loads(settings: dict, classes: int, path: Path, dims, saved_ranks: int) -> list[float]:
    from trainer.checkpoint.components import load_checkpoint

    times = []
    for _ in range(settings["saves"]):
        state, parts = bench_state(settings, classes, dims, saved_ranks, empty=True)
        if dims.is_distributed:
            dist.barrier(group=dims.control_group)
        started = time.perf_counter()
        load_checkpoint(path, state, dims)
        times.append(_slowest(time.perf_counter() - started, dims))
        check_loaded(parts, dims)
    return times


def _join_job():
    """This process as a rank of the bench's job, set up as training sets up a rank."""
    from trainer.parallel import init_distributed
    from trainer.parallel.host_memory import keep_freed_host_memory

    dims = init_distributed()
    keep_freed_host_memory(dims.device)
    return dims


def _save_worker(settings: dict, classes: int, directory: str, out: str) -> None:
    """On each of ``ranks`` processes: synchronous saves, asynchronous ones, loads."""
    from trainer.checkpoint.async_checkpoint import AsyncCheckpointer

    dims = _join_job()
    state, _ = bench_state(settings, classes, dims, dims.world_size)
    checkpointer = AsyncCheckpointer(directory, dims, keep_last=2, log=lambda message: None)
    found = {"sync": [], "stall": [], "background": []}
    step = 0

    def save_async() -> tuple[float, float]:
        nonlocal step
        step += 1
        started = time.perf_counter()
        checkpointer.save(step, state)
        stall = _slowest(time.perf_counter() - started, dims)
        checkpointer.wait()
        return stall, _slowest(checkpointer.last_result.total_s, dims)

    try:
        found["first_stall"] = save_async()[0]  # allocates the host buffers
        for _ in range(settings["saves"]):  # alternating, so both kinds see the same state of the disk
            step += 1
            started = time.perf_counter()
            checkpointer.save(step, state, blocking=True)
            found["sync"].append(_slowest(time.perf_counter() - started, dims))
            stall, background = save_async()
            found["stall"].append(stall)
            found["background"].append(background)
        found["load"] = _time_loads(settings, classes, checkpointer.last_complete, dims, dims.world_size)
    finally:
        checkpointer.close()
    if dims.rank == 0:
        Path(out).write_text(json.dumps(found))


def _reshard_worker(settings: dict, classes: int, checkpoint: str, saved_ranks: int, out: str) -> None:
    dims = _join_job()
    times = _time_loads(settings, classes, Path(checkpoint), dims, saved_ranks)
    if dims.rank == 0:
        Path(out).write_text(json.dumps({"reshard_load": times}))


def run(settings: CheckpointBenchSettings, progress=print) -> dict:
    """Every measurement of every column, as medians (seconds) with the sizes behind them."""
    from trainer.checkpoint.checkpoint_files import complete_checkpoints
    from trainer.parallel.launch import spawn_local_workers

    if settings.ranks < 1 or settings.reshard_ranks < 1 or settings.saves < 1 or settings.job_ranks < 1:
        raise ValueError("bench checkpoint: --ranks, --reshard-ranks, --saves and --job-ranks must be >= 1")
    if settings.reshard_ranks == settings.ranks:
        raise ValueError(f"bench checkpoint: --reshard-ranks must differ from --ranks ({settings.ranks}): it is the "
                         "load onto another world size")
    root = Path(settings.directory or tempfile.mkdtemp(prefix="instcls-bench-checkpoint-"))
    columns = {}
    try:
        for dataset in settings.datasets:
            classes = int(dataset)
            work = root / f"n{classes}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            progress(f"N = {classes:,}: {settings.ranks} ranks save and load ...")
            spawn_local_workers(_save_worker, settings.ranks, asdict(settings), classes, str(work / "checkpoints"),
                                str(work / "save.json"))
            found = json.loads((work / "save.json").read_text())
            newest = complete_checkpoints(work / "checkpoints")[-1]
            progress(f"N = {classes:,}: {settings.reshard_ranks} ranks load it ...")
            spawn_local_workers(_reshard_worker, settings.reshard_ranks, asdict(settings), classes, str(newest),
                                settings.ranks, str(work / "reshard.json"))
            found.update(json.loads((work / "reshard.json").read_text()))
            columns[dataset] = _summary(settings, classes, found, newest)
    finally:
        if settings.directory is None:
            shutil.rmtree(root, ignore_errors=True)
    return {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
            "columns": columns}


def _summary(settings: CheckpointBenchSettings, classes: int, found: dict, checkpoint: Path) -> dict:
    median = {key: statistics.median(values) for key, values in found.items() if isinstance(values, list)}
    rows = classes // settings.job_ranks
    rank_bytes = rows * settings.dim * 2 * 4 + settings.backbone_params * (1 + settings.optimizer_states) * 4 \
        // settings.job_ranks
    worst_preemption = median["background"] + median["sync"]
    return {
        "classes": classes, "rows_per_rank": rows, "rank_mb": rank_bytes / MB,
        "rank0_extra_mb": settings.backbone_params * (1 + settings.optimizer_states) * 4 / MB,
        "checkpoint_mb": sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) / MB,
        "sync_s": median["sync"], "stall_s": median["stall"], "first_stall_s": found["first_stall"],
        "background_s": median["background"], "load_s": median["load"], "reshard_load_s": median["reshard_load"],
        "stall_ratio": median["stall"] / median["sync"], "preemption_worst_s": worst_preemption,
        "preemption_margin_s": settings.grace_seconds - worst_preemption,
    }


def format_report(summary: dict) -> str:
    settings, columns = summary["settings"], summary["columns"]
    names = {str(IMAGENET_21K): "ImageNet-21K", str(IMAGENET_1K): "ImageNet-1K"}
    heads = [f"{names.get(key, 'N=' + key)} / {settings['job_ranks']}" for key in columns]
    grace = settings["grace_seconds"]
    lines = [
        ("classifier rows per rank", lambda c: f"{c['rows_per_rank']:,}"),
        ("state per rank (rank 0: + consolidated)", lambda c: f"{c['rank_mb']:.0f} MB (+{c['rank0_extra_mb']:.0f})"),
        ("checkpoint on disk", lambda c: f"{c['checkpoint_mb']:.0f} MB"),
        ("synchronous save", lambda c: f"{c['sync_s']:.2f} s"),
        ("async save: the step's stall", lambda c: f"{c['stall_s']:.3f} s"),
        ("  stall / synchronous save (goal <= 0.10)", lambda c: f"{c['stall_ratio']:.3f}"),
        ("  first async save's stall (allocates)", lambda c: f"{c['first_stall_s']:.3f} s"),
        ("  written in the background in", lambda c: f"{c['background_s']:.2f} s"),
        (f"load on {settings['ranks']} ranks (as saved)", lambda c: f"{c['load_s']:.2f} s"),
        (f"load onto {settings['reshard_ranks']} ranks (resharded)", lambda c: f"{c['reshard_load_s']:.2f} s"),
        ("preemption save, worst case (in flight + blocking)", lambda c: f"{c['preemption_worst_s']:.1f} s"),
        (f"  margin within a {grace:.0f} s grace period", lambda c: f"{c['preemption_margin_s']:.0f} s "
                                                                  f"({grace / c['preemption_worst_s']:.0f}x)"),
    ]
    width = max(len(label) for label, _ in lines) + 2
    out = ["".ljust(width) + "".join(head.rjust(20) for head in heads)]
    for label, cell in lines:
        out.append(label.ljust(width) + "".join(cell(columns[key]).rjust(20) for key in columns))
    out.append(f"{settings['ranks']} local ranks, each one rank's share of a {settings['job_ranks']}-rank job; "
               "medians of the slowest rank; loads from the page cache.")
    return "\n".join(out)
