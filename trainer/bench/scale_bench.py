"""`instcls bench scale`: the bookkeeping of one ImageNet-21K epoch, without the images.

Every item (``trainer.bench.scale_items``) is timed with its peak memory at ``num_samples`` and at
``compare_samples`` side by side, so the growth column shows how each cost scales: work done once
per step should not grow with N (ratio ~1), work done once per epoch or per process may grow like
N (ratio ~N/N'), and nothing should grow faster.  The last column is what the measured cost means
for one epoch on each of ``ranks`` ranks: per-step items x steps per epoch, others once.
"""

from __future__ import annotations

import gc
import math
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from trainer.bench import scale_items as items
from trainer.bench.settings.scale import ScaleBenchSettings
from trainer.observability.memory import peak_since, reset_peak, status_field_bytes

MIB = 2**20
LEGACY = "format-1 sets: parse the .idx files (measured on <= 20k, x N)"
CPU = torch.device("cpu")
# when an item runs, and how many times per epoch (None: not per epoch)
PER_PROCESS, PER_EPOCH, PER_STEP, PER_RESUME, PER_INGEST = "process start", "epoch", "step", "resume", "ingest"


def _measure(function, per: int = 1) -> dict:
    """Seconds (per ``per`` repeats inside ``function``), peak RSS above the start, and how much
    of the RSS the call left are pages of mapped files (the page cache's: shared by every rank of
    a node, not memory of this process), in MiB.  What ``function`` returns is kept alive until
    that is read."""
    baseline = reset_peak(CPU)
    file_pages = status_field_bytes("RssFile")
    started = time.perf_counter()
    result = function()
    seconds = (time.perf_counter() - started) / per
    _, above = peak_since(CPU, baseline)
    mapped = max(status_field_bytes("RssFile") - file_pages, 0)
    del result
    return {"seconds": seconds, "peak_mib": max(above, 0) / MIB, "file_mib": mapped / MIB}


def _one_size(settings: ScaleBenchSettings, num_samples: int, work: Path) -> dict[str, dict]:
    scale = items.Scale(num_samples, settings.ranks, settings.batch, settings.new_ranks, settings.dim,
                        settings.top_k, settings.queue_size, settings.samples_per_shard, settings.steps)
    gc.collect()  # once: a full collection takes 0.3 s in a process that has imported torch
    out = {}
    write, table_dir = items.prepare_table_write(scale, work)
    out["write the sample table"] = _measure(write)
    out["open the sample table (+ one step's lookups)"] = _measure(items.prepare_table_open(scale, table_dir))
    parse = items.prepare_legacy_parse(scale, work)
    legacy = _measure(parse)
    legacy["seconds"] *= num_samples / items.legacy_samples(scale)
    legacy["peak_mib"] *= num_samples / items.legacy_samples(scale)
    out[LEGACY] = legacy
    permute, sampler = items.prepare_epoch_permutation(scale)
    out["epoch permutation"] = _measure(permute)
    out["step plan, epoch permutation (this + next step)"] = _measure(*items.prepare_step_plan(scale, sampler))
    del sampler
    out["sliding window: permutation + first window"] = _measure(items.prepare_sliding_window(scale))
    out["step plan, sliding window (this + next step)"] = _measure(*items.prepare_window_steps(scale))
    build, holder = items.prepare_hard_negative_index(scale)
    out["hard-negative index of one rank (K per row)"] = _measure(build)
    out["hard-negative lookup of the global batch"] = _measure(items.prepare_hard_negative_lookup(scale, holder),
                                                               settings.steps)
    holder.clear()
    out["PIC recent ids: sampled set + local rows + push"] = _measure(items.prepare_recent_ids(scale), settings.steps)
    out[f"checkpoint rows re-split {settings.ranks} -> {settings.new_ranks} ranks (one rank)"] = _measure(
        items.prepare_row_resplit(scale, work))
    return out


WHEN = {"write the sample table": PER_INGEST, "open the sample table (+ one step's lookups)": PER_PROCESS,
        LEGACY: PER_PROCESS, "epoch permutation": PER_EPOCH,
        "sliding window: permutation + first window": PER_PROCESS,
        "hard-negative index of one rank (K per row)": PER_EPOCH}


def when(item: str) -> str:
    if item.startswith("checkpoint rows"):
        return PER_RESUME
    return WHEN.get(item, PER_STEP)


def run(settings: ScaleBenchSettings, progress=print) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's share of a node's cores, and the same figures on any machine
    try:
        return _run(settings, progress)
    finally:
        torch.set_num_threads(threads)


def _run(settings: ScaleBenchSettings, progress) -> dict:
    with tempfile.TemporaryDirectory(dir=settings.work_dir) as scratch:
        results = {}
        for num_samples in (settings.compare_samples, settings.num_samples):
            progress(f"bench scale: N = {num_samples} ...")
            results[num_samples] = _one_size(settings, num_samples, Path(scratch))
    steps_per_epoch = -(-settings.num_samples // (settings.ranks * settings.batch))
    return {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
            "steps_per_epoch": steps_per_epoch, "results": {str(n): r for n, r in results.items()}}


def _time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


# Growth exponent e in time ~ N^e: per-step work must stay near 0; O(N) work measures 1 to ~1.5
# here (a permutation of 14M ids no longer fits the caches), O(N^2) would measure 2.
FLAT, LINEAR = 0.3, 1.7


def exponent(ratio: float, size_ratio: float) -> float:
    return math.log(max(ratio, 1e-9)) / math.log(size_ratio)


def verdict(item: str, ratio: float, size_ratio: float) -> str:
    power = exponent(ratio, size_ratio)
    if when(item) == PER_STEP:
        return "flat" if power < FLAT else "GROWS WITH N PER STEP"
    return "<= N" if power < LINEAR else "FASTER THAN N"


def format_report(summary: dict) -> str:
    settings = summary["settings"]
    small, large = settings["compare_samples"], settings["num_samples"]
    first, second = summary["results"][str(small)], summary["results"][str(large)]
    steps = summary["steps_per_epoch"]
    lines = [f"bench scale: N = {large} vs {small}, {settings['ranks']} ranks x batch {settings['batch']} "
             f"({steps} steps per epoch), K = {settings['top_k']} hard negatives, queue {settings['queue_size']}",
             "", f"| item | when | N={small} | N={large} | peak MiB at N={large} (mapped file pages) | growth | "
             "per epoch per rank |",
             "|---|---|---|---|---|---|---|"]
    for item, measured in second.items():
        base = first[item]["seconds"]
        ratio = measured["seconds"] / base if base > 0 else float("inf")
        per_epoch = {PER_STEP: _time(measured["seconds"] * steps), PER_EPOCH: _time(measured["seconds"])}.get(
            when(item), "-")
        lines.append(
            f"| {item} | per {when(item)} | {_time(base)} | {_time(measured['seconds'])} | "
            f"{measured['peak_mib']:.0f} ({measured.get('file_mib', 0):.0f}) | "
            f"x{ratio:.1f} = N^{exponent(ratio, large / small):.2f}, "
            f"{verdict(item, ratio, large / small)} | {per_epoch} |"
        )
    return "\n".join(lines)
