"""`instcls bench classifier`: one training step of the classifier, DHP vs replicated (DDP).

Both modes see the same global batch B of random features: DHP gathers it on every rank and
scores N/T classes, replicated scores its B/T local rows against all N classes and all-reduces the
N x D weight gradient.  Each mode runs in fresh worker processes so its peak memory is its own.

The roofline is a plain ``torch.mm`` (into a reused output) of the DHP shapes ``[B, D] x [D, N/T]`` timed in the same
processes right after, with the same threads.  A DHP step executes four such matmuls (forward,
the backward's recomputation, feature gradient, weight gradient), so its FLOPs are 8*B*(N/T)*D.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.bench.step_runner import StepSpec, run_steps, synchronize
from trainer.observability.memory import peak_since, reset_peak
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

MIB = 2**20


@dataclass(frozen=True)
class ClassifierBenchSettings:
    num_classes: int = 1_000_000
    batch: int = 256  # global batch B (B / T per rank)
    dim: int = 128
    ranks: int = 2
    chunk_size: int = 65536
    steps: int = 3
    warmup: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.batch % self.ranks:
            raise ValueError(f"--batch {self.batch} must be divisible by --ranks {self.ranks} (equal local batches)")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("--steps must be >= 1 and --warmup >= 0")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype {self.dtype!r}: choose float32, bfloat16 or float16")
        if torch.cuda.is_available() and torch.cuda.device_count() < self.ranks:
            raise ValueError(f"--ranks {self.ranks} needs that many GPUs; this machine has {torch.cuda.device_count()}")


def _step_spec(settings: ClassifierBenchSettings, mode: str, num_classes: int, steps: int) -> StepSpec:
    return StepSpec(num_classes=num_classes, batch=settings.batch, dim=settings.dim, chunk_size=settings.chunk_size,
                    mode=mode, dtype=settings.dtype, steps=steps, warmup=settings.warmup)


def _worker(settings: ClassifierBenchSettings, mode: str, result_path: str) -> None:
    dims = init_distributed()
    device = dims.device
    # A tiny run first loads everything the step touches once per process (optimizer internals,
    # collective buffers, kernels), so the measured peak is the classifier's own memory.
    run_steps(_step_spec(settings, mode, num_classes=max(settings.ranks, 16), steps=1), dims)
    baseline = reset_peak(device)
    stats = run_steps(_step_spec(settings, mode, settings.num_classes, settings.steps), dims)
    peak, peak_above_baseline = peak_since(device, baseline)

    dtype = getattr(torch, settings.dtype)
    roofline_gflops = _matmul_gflops(settings, stats.num_classes_local, device, dtype) if mode == "dhp" else None
    result = dict(
        rank=dims.rank,
        step_s=stats.step_s,
        weight_grad_sync_s=stats.weight_grad_sync_s,
        peak_bytes=peak,
        peak_above_baseline_bytes=peak_above_baseline,
        num_classes_local=stats.num_classes_local,
        rows_scored=stats.rows_scored,
        matmul_gflops=roofline_gflops,
    )
    gathered: list[dict] = [None] * dims.world_size  # type: ignore[list-item]
    dist.all_gather_object(gathered, result)
    if dims.rank == 0:
        Path(result_path).write_text(json.dumps(gathered))


def _matmul_gflops(settings: ClassifierBenchSettings, num_classes_local: int, device: torch.device, dtype) -> float:
    """GFLOP/s of ``[B, D] x [D, N_local]`` on this rank while the other ranks do the same."""
    a = torch.randn(settings.batch, settings.dim, device=device, dtype=dtype)
    b = torch.randn(settings.dim, num_classes_local, device=device, dtype=dtype)
    out = torch.mm(a, b)  # reused, as the classifier reuses its chunk workspace
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    repeats = max(2, settings.steps)
    for _ in range(repeats):
        torch.mm(a, b, out=out)
    synchronize(device)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * settings.batch * num_classes_local * settings.dim / seconds / 1e9


def run_mode(settings: ClassifierBenchSettings, mode: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "result.json")
        spawn_local_workers(_worker, settings.ranks, settings, mode, result_path)
        return json.loads(Path(result_path).read_text())


def summarize(settings: ClassifierBenchSettings, per_mode: dict[str, list[dict]]) -> dict:
    """One row per mode (worst rank for time and memory) plus the ratios we track."""
    rows = {}
    for mode, ranks in per_mode.items():
        step_s = max(r["step_s"] for r in ranks)
        executed_flops = 8 * max(r["rows_scored"] * r["num_classes_local"] for r in ranks) * settings.dim
        rows[mode] = dict(
            step_s=step_s,
            weight_grad_sync_s=max(r["weight_grad_sync_s"] for r in ranks),
            peak_mib=max(r["peak_bytes"] for r in ranks) / MIB,
            peak_above_baseline_mib=max(r["peak_above_baseline_bytes"] for r in ranks) / MIB,
            gflops_per_rank=executed_flops / step_s / 1e9,
        )
    dhp, replicated = rows["dhp"], rows["replicated"]
    matmul = min(r["matmul_gflops"] for r in per_mode["dhp"])
    return dict(
        settings=asdict(settings),
        device="cuda" if torch.cuda.is_available() else "cpu",
        modes=rows,
        matmul_gflops_per_rank=matmul,
        dhp_speedup=replicated["step_s"] / dhp["step_s"],
        replicated_over_dhp_memory=replicated["peak_above_baseline_mib"] / dhp["peak_above_baseline_mib"],
        dhp_fraction_of_matmul=dhp["gflops_per_rank"] / matmul,
    )


def format_report(summary: dict) -> str:
    s = summary["settings"]
    lines = [
        f"classifier step: N={s['num_classes']:,} B={s['batch']} D={s['dim']} T={s['ranks']} "
        f"chunk={s['chunk_size']} dtype={s['dtype']} on {summary['device']} "
        f"(mean of {s['steps']} steps after {s['warmup']} warm-up; worst rank)",
        f"{'mode':<11}{'step s':>9}{'W-grad sync s':>15}{'peak MiB':>11}{'peak-base MiB':>15}{'GFLOP/s/rank':>14}",
    ]
    for mode, row in summary["modes"].items():
        lines.append(
            f"{mode:<11}{row['step_s']:>9.3f}{row['weight_grad_sync_s']:>15.3f}{row['peak_mib']:>11.0f}"
            f"{row['peak_above_baseline_mib']:>15.0f}{row['gflops_per_rank']:>14.1f}"
        )
    lines += [
        f"plain matmul [B,D]x[D,N/T], same processes: {summary['matmul_gflops_per_rank']:.1f} GFLOP/s/rank",
        f"DHP speed-up over replicated:      {summary['dhp_speedup']:.2f}x",
        f"replicated / DHP memory (peak-base): {summary['replicated_over_dhp_memory']:.2f}x",
        f"DHP step vs matmul roofline:       {100 * summary['dhp_fraction_of_matmul']:.0f}%",
    ]
    return "\n".join(lines)


def run(settings: ClassifierBenchSettings) -> dict:
    per_mode = {mode: run_mode(settings, mode) for mode in ("dhp", "replicated")}
    return summarize(settings, per_mode)
