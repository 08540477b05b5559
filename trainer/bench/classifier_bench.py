"""`instcls bench classifier`: one training step of the classifier, DHP vs DDP, logits recomputed
in the backward vs kept in the logits cache.

Both modes see the same global batch B of random features: DHP gathers it on every rank and
scores N/T classes, DDP scores its B/T local rows against all N classes and all-reduces the N x D
weight gradient.  Each (mode, logits) run has fresh worker processes, so its peak memory is its own.

Useful work is what any implementation must do: the forward logits, the feature gradient and the
weight gradient, 3 matmuls or ``6 * B * D * N / T`` FLOPs per rank and step in either mode (the
recomputation of the logits is not counted).  It is compared with a plain ``torch.mm`` of the DHP
shapes ``[B, D] x [D, N/T]`` timed in the same processes after each step, with the same threads,
so both see the same moments of a shared machine.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from statistics import fmean

import torch
import torch.distributed as dist

from trainer.bench.classifier_roofline import exp2_rate, roofline
from trainer.bench.device_ceilings import copy_gb_per_s, matmul_tflops
from trainer.bench.settings.classifier import ClassifierBenchSettings
from trainer.bench.step_runner import StepSpec, run_steps, synchronize
from trainer.classifier.classifier_config import MODES
from trainer.observability.memory import peak_since, reset_peak
from trainer.parallel import init_distributed
from trainer.parallel.host_memory import keep_freed_host_memory
from trainer.parallel.launch import spawn_local_workers

MIB = 2**20
LOGITS = ("recompute", "cache")


def _step_spec(settings: ClassifierBenchSettings, mode: str, num_classes: int, steps: int, cache_bytes: int,
               kernel: str):
    return StepSpec(num_classes=num_classes, batch=settings.batch, dim=settings.dim, chunk_size=settings.chunk_size,
                    mode=mode, logits_cache_bytes=cache_bytes, dtype=settings.dtype, steps=steps,
                    warmup=settings.warmup, kernel=kernel)


def _worker(settings: ClassifierBenchSettings, mode: str, logits: str, kernel: str, result_path: str) -> None:
    dims = init_distributed()
    keep_freed_host_memory(dims.device)  # as training does (trainer.parallel.host_memory)
    device = dims.device
    cache_bytes = settings.cache_bytes(mode) if logits == "cache" else 0
    # A tiny run first loads everything the step touches once per process (optimizer internals,
    # collective buffers, kernels), so the measured peak is the classifier's own memory.
    run_steps(_step_spec(settings, mode, max(settings.ranks, 16), 1, cache_bytes, kernel), dims)
    matmul = _PlainMatmul(settings, device, getattr(torch, settings.dtype))
    gpu = device.type == "cuda"
    bandwidth = copy_gb_per_s(device, (1 << 30) if gpu else (128 << 20), repeats=5)
    # The roofline's matmul rate: a square product, compute-bound (the DHP-shaped one above writes a
    # [B, N/T] output with K = D = 128 and is bound by that write: 16% of peak on an H200).
    peak_tflops = matmul_tflops(device, getattr(torch, settings.dtype), 8192 if gpu else 1024, repeats=5)
    baseline = reset_peak(device)
    stats = run_steps(_step_spec(settings, mode, settings.num_classes, settings.steps, cache_bytes, kernel), dims,
                      after_step=matmul.time_one)
    peak, peak_above_baseline = peak_since(device, baseline)
    result = dict(
        rank=dims.rank,
        step_s=stats.step_s,
        weight_grad_sync_s=stats.weight_grad_sync_s,
        peak_bytes=peak,
        peak_above_baseline_bytes=peak_above_baseline,
        matmul_gflops=matmul.gflops(),
        copy_gb_per_s=bandwidth,
        peak_matmul_gflops=peak_tflops * 1e3,
        exp2_per_s=exp2_rate(device),
    )
    gathered: list[dict] = [None] * dims.world_size  # type: ignore[list-item]
    dist.all_gather_object(gathered, result)
    if dims.rank == 0:
        Path(result_path).write_text(json.dumps(gathered))


class _PlainMatmul:
    """``[B, D] x [D, N/T]`` into a reused output (as the classifier reuses its chunk workspace),
    timed once after each step on every rank at once; its inputs count in the baseline memory."""

    def __init__(self, settings: ClassifierBenchSettings, device: torch.device, dtype) -> None:
        self.device = device
        self.a = torch.randn(settings.batch, settings.dim, device=device, dtype=dtype)
        self.b = torch.randn(settings.dim, settings.classes_scored("dhp"), device=device, dtype=dtype)
        self.out = torch.mm(self.a, self.b)
        self.flops = 2 * settings.batch * settings.classes_scored("dhp") * settings.dim
        self.seconds: list[float] = []

    def time_one(self) -> None:
        dist.barrier()
        synchronize(self.device)
        start = time.perf_counter()
        torch.mm(self.a, self.b, out=self.out)
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - start)

    def gflops(self) -> float:
        return self.flops / fmean(self.seconds) / 1e9


def run_variant(settings: ClassifierBenchSettings, mode: str, logits: str, kernel: str = "chunked") -> list[dict]:
    """Per-rank results of one (mode, logits, kernel) run in fresh processes."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "result.json")
        spawn_local_workers(_worker, settings.ranks, settings, mode, logits, kernel, result_path)
        return json.loads(Path(result_path).read_text())


def summarize_run(settings: ClassifierBenchSettings, mode: str, logits: str, ranks: list[dict],
                  kernel: str = "chunked") -> dict:
    """One row: the worst rank for time and memory, the slowest rank's matmul as the roofline."""
    step_s = max(r["step_s"] for r in ranks)
    useful_gflops = settings.useful_flops(mode) / step_s / 1e9
    matmul_gflops = min(r["matmul_gflops"] for r in ranks)
    floor = roofline(f"{kernel}/{logits}", settings.rows_scored(mode), settings.classes_scored(mode), settings.dim,
                     torch.empty((), dtype=getattr(torch, settings.dtype)).element_size(),
                     min(r["peak_matmul_gflops"] for r in ranks), min(r["copy_gb_per_s"] for r in ranks),
                     ranks[0]["exp2_per_s"])
    return dict(
        mode=mode,
        logits=logits,
        kernel=kernel,
        roofline=floor,
        over_roofline=step_s / floor["seconds"],
        cache_bytes=settings.cache_bytes(mode) if logits == "cache" else 0,
        step_s=step_s,
        weight_grad_sync_s=max(r["weight_grad_sync_s"] for r in ranks),
        peak_mib=max(r["peak_bytes"] for r in ranks) / MIB,
        peak_above_baseline_mib=max(r["peak_above_baseline_bytes"] for r in ranks) / MIB,
        useful_gflops_per_rank=useful_gflops,
        matmul_gflops_per_rank=matmul_gflops,
        useful_fraction_of_matmul=useful_gflops / matmul_gflops,
    )


def summarize(settings: ClassifierBenchSettings, runs: list[dict]) -> dict:
    by_key = {(run["mode"], run["logits"]): run for run in runs if run["kernel"] == "chunked"}
    fused = {run["mode"]: run for run in runs if run["kernel"] == "fused"}
    return dict(
        settings=asdict(settings),
        device="cuda" if torch.cuda.is_available() else "cpu",
        useful_flops_per_rank=settings.useful_flops("dhp"),
        runs=runs,
        dhp_speedup={logits: by_key["ddp", logits]["step_s"] / by_key["dhp", logits]["step_s"] for logits in LOGITS},
        ddp_over_dhp_memory={
            logits: by_key["ddp", logits]["peak_above_baseline_mib"] / by_key["dhp", logits]["peak_above_baseline_mib"]
            for logits in LOGITS
        },
        fused_speedup={mode: by_key[mode, "recompute"]["step_s"] / run["step_s"] for mode, run in fused.items()},
    )


def format_report(summary: dict) -> str:
    s = summary["settings"]
    cache_mib = max(run["cache_bytes"] for run in summary["runs"]) / MIB
    lines = [
        f"classifier step: N={s['num_classes']:,} B={s['batch']} D={s['dim']} T={s['ranks']} "
        f"chunk={s['chunk_size']} dtype={s['dtype']} on {summary['device']} "
        f"(mean of {s['steps']} steps after {s['warmup']} warm-up; worst rank)",
        f"useful work per rank and step: 6*B*D*N/T = {summary['useful_flops_per_rank'] / 1e9:.1f} GFLOP; "
        f"logits cache: {cache_mib:.0f} MiB per rank",
        f"{'kernel':<8}{'mode':<6}{'logits':<11}{'step s':>8}{'W-grad sync s':>15}{'peak MiB':>10}"
        f"{'peak-base MiB':>15}{'useful GFLOP/s':>16}{'matmul GFLOP/s':>16}{'useful/matmul':>15}"
        f"{'roofline s':>12}{'bound':>8}{'x roofline':>12}",
    ]
    for run in summary["runs"]:
        lines.append(
            f"{run['kernel']:<8}{run['mode']:<6}{run['logits']:<11}{run['step_s']:>8.4f}"
            f"{run['weight_grad_sync_s']:>15.3f}{run['peak_mib']:>10.0f}{run['peak_above_baseline_mib']:>15.0f}"
            f"{run['useful_gflops_per_rank']:>16.1f}{run['matmul_gflops_per_rank']:>16.1f}"
            f"{100 * run['useful_fraction_of_matmul']:>14.0f}%{run['roofline']['seconds']:>12.4f}"
            f"{run['roofline']['bound']:>8}{run['over_roofline']:>11.2f}x"
        )
    speedup, memory = summary["dhp_speedup"], summary["ddp_over_dhp_memory"]
    lines += [
        "(GFLOP/s are per rank; matmul: a plain [B,D]x[D,N/T] torch.mm in the same processes; roofline: the largest "
        "of the path's matmuls at a square torch.mm's rate, its exp2 at the special-function units' rate and its "
        "bytes at the copy bandwidth, each measured in the same processes: trainer/bench/classifier_roofline.py)",
        f"DHP speed-up over DDP:            {speedup['recompute']:.2f}x recompute, {speedup['cache']:.2f}x cache",
        f"DDP / DHP memory (peak-base):     {memory['recompute']:.2f}x recompute, {memory['cache']:.2f}x cache",
    ]
    if summary["fused_speedup"]:
        lines.append("fused over chunked (recompute):   " + ", ".join(
            f"{ratio:.2f}x {mode}" for mode, ratio in summary["fused_speedup"].items()))
    else:
        lines.append("fused kernel: not run (it needs a CUDA device; on CPUs it runs under Triton's interpreter in "
                     "the tests)")
    return "\n".join(lines)


def run(settings: ClassifierBenchSettings) -> dict:
    # Checked here, not when the settings are made: the command line builds default settings for its
    # help text on every machine, a one-GPU machine included.
    if torch.cuda.is_available() and torch.cuda.device_count() < settings.ranks:
        raise ValueError(f"--ranks {settings.ranks} needs that many GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    settings = settings.on_this_machine()  # the chunk size of this machine's device, unless given
    variants = [(mode, logits, "chunked") for mode in MODES for logits in LOGITS]
    if torch.cuda.is_available():  # the fused kernels keep no logits: no cache variant
        variants += [(mode, "recompute", "fused") for mode in MODES]
    runs = [summarize_run(settings, mode, logits, run_variant(settings, mode, logits, kernel), kernel)
            for mode, logits, kernel in variants]
    return summarize(settings, runs)
