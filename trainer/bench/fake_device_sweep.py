"""The paper's Figure 3 at its real scale, on fake CUDA devices: the largest N each mode fits.

The paper trains ResNet-50 with global batch 4096 on 64 V100-32GB and reports DDP (W replicated,
its gradient all-reduced) out of memory at 4.7M classes and DHP (W sharded) fitting 30M: 6.4x.
Here the classifier's step is *executed* at each N as rank 0 of 64 (the largest shard) by the dry
run (``trainer.dry_run``): W, its gradient and momentum, the chunk workspace, the all-gathered
features, DDP's N x D all-reduce.  The ResNet-50 under ZeRO, DALI and the runtime are counted by
the planner's formula (DeepSpeed's engine needs a real device) and added to each point.  N grows
from the planner's answer: the search brackets the boundary around it (widening by ``growth`` until
one side fits and the other does not) and bisects.  The planner's own answer (``instcls plan``)
and the paper's are printed beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainer.config import JobConfig
from trainer.planning import GIB, backbone_breakdown, largest_classes, runtime_breakdown

PAPER = {"ddp": 4_700_000, "dhp": 30_000_000}  # classes at 64 x V100-32GB (the paper's Figure 3)
# Batches are drawn from the first 2^24 ids: the sampler's permutation of N ids is real host memory
# (25 GB at N = 3.1 billion), and the classifier's memory does not depend on which ids a batch holds.
SAMPLED_IDS = 1 << 24


@dataclass(frozen=True)
class FakeSweep:
    ranks: int = 64
    batch: int = 4096  # global
    dim: int = 128
    chunk_size: int = 65536
    deepspeed_config: str = "zero2_bf16"
    growth: float = 1.25  # how far apart the first bracket around the planner's answer is, and how it widens
    resolution: float = 0.02  # bisect until the boundary is known within 2%
    on_device: bool = False  # execute rank 0's step on this machine's GPU instead (``dry_run.on_device``)


def _job(sweep: FakeSweep, mode: str) -> JobConfig:
    """The instance objective without label smoothing or the prior (the classifier alone, as in
    the paper's comparison), on the sweep's shape."""
    import ds_configs
    from trainer.config_building import build_dataclass

    data = {
        "data": {"train_shards": "(fake)", "loader": {"batch_size": sweep.batch // sweep.ranks}},
        "model": {"arch": "resnet50", "feature_dim": sweep.dim},
        "objective": {"name": "instance", "mode": mode, "smoothing_alpha": 0.0, "contrastive_prior": False,
                      "chunk_size": sweep.chunk_size},
        "parallel": {"device": "cuda"},
        "deepspeed_config": sweep.deepspeed_config,
    }
    config = build_dataclass(JobConfig, data, "")
    return replace(config, deepspeed_config=ds_configs.resolve(config.deepspeed_config))


def _rest_of_the_rank(config: JobConfig, sweep: FakeSweep) -> int:
    """Backbone, ZeRO, DALI and runtime bytes per rank by the planner's formula (independent of N)."""
    from trainer.planning.plan_from_config import plan_input_from_config

    plan = plan_input_from_config(config, sweep.ranks, sweep.ranks)
    return sum((backbone_breakdown(plan) | runtime_breakdown(plan)).values())


def executed_peak(config: JobConfig, sweep: FakeSweep, num_classes: int) -> int:
    """Rank 0's peak device bytes over two executed classifier steps at ``num_classes`` (the second
    is the steady state: its backward runs with the momentum buffers the first update created)."""
    if sweep.on_device:
        return _on_device(config, sweep, num_classes).report.peak_bytes
    from trainer.dry_run.rank_step import run_rank

    report = run_rank(config, num_classes, sweep.ranks, rank=0, steps=2, sampled_ids=SAMPLED_IDS)
    if report.stopped:
        raise RuntimeError(f"the dry run of N={num_classes} stopped: {report.stopped}")
    return report.peak_bytes


def _on_device(config: JobConfig, sweep: FakeSweep, num_classes: int, steps: int = 2):
    import torch

    from trainer.dry_run.on_device import run_rank_on_device

    torch.cuda.empty_cache()  # each point's peak starts from an empty cache
    measured = run_rank_on_device(config, num_classes, sweep.ranks, rank=0, steps=steps, sampled_ids=SAMPLED_IDS)
    if measured.report.stopped:
        raise RuntimeError(f"the step of N={num_classes} on the device stopped: {measured.report.stopped}")
    return measured


def step_seconds_on_device(mode: str, num_classes: int, sweep: FakeSweep) -> float:
    """Median seconds of rank 0's step after the first of 4, on this GPU (no communication time)."""
    seconds = _on_device(_job(sweep, mode), sweep, num_classes, steps=4).step_seconds[1:]
    return sorted(seconds)[len(seconds) // 2]


def largest_fitting(mode: str, cap_bytes: int, sweep: FakeSweep, progress=None) -> int:
    """The largest N whose executed step plus the rest of the rank fits ``cap_bytes`` (0: none does)."""
    config = _job(sweep, mode)
    rest = _rest_of_the_rank(config, sweep)

    def fits(n: int) -> bool:
        total = executed_peak(config, sweep, n) + rest
        if progress is not None:
            progress(f"{mode} N={n:,}: {total / GIB:.2f} GiB of {cap_bytes / GIB:g}")
        return total <= cap_bytes

    guess = max(planned_largest(mode, cap_bytes, sweep), sweep.ranks)
    low, high = int(guess / sweep.growth), int(guess * sweep.growth)
    while not fits(low):  # widen downwards until something fits (nothing below one class per rank)
        low, high = low // 2, low
        if low < sweep.ranks:
            return 0
    while fits(high):
        low, high = high, int(high * sweep.growth)
    while high - low > max(sweep.ranks, low * sweep.resolution):
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def planned_largest(mode: str, cap_bytes: int, sweep: FakeSweep) -> int:
    from trainer.planning.plan_from_config import plan_input_from_config

    return largest_classes(plan_input_from_config(_job(sweep, mode), sweep.ranks, sweep.ranks), cap_bytes)


def run(caps_gib: list[float], sweep: FakeSweep, progress=None) -> list[dict]:
    rows = []
    for cap in caps_gib:
        row = {"cap_gib": cap}
        for mode in ("ddp", "dhp"):
            row[f"{mode}_executed"] = largest_fitting(mode, int(cap * GIB), sweep, progress)
            row[f"{mode}_planned"] = planned_largest(mode, int(cap * GIB), sweep)
        if sweep.on_device and row["ddp_executed"]:  # both modes at the largest N that DDP fits
            row.update({f"{mode}_step_s": step_seconds_on_device(mode, row["ddp_executed"], sweep)
                        for mode in ("ddp", "dhp")})
        rows.append(row)
    return rows


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M"


def _ratio(dhp: int, ddp: int) -> str:
    return f"{dhp / ddp:.1f}x" if ddp else "-"


def format_table(rows: list[dict], sweep: FakeSweep) -> str:
    where = "on this GPU (real tensors)" if sweep.on_device else "on fake CUDA devices"
    lines = [
        f"largest N per rank's memory: {sweep.ranks} ranks, global batch {sweep.batch}, D {sweep.dim}, "
        f"{sweep.deepspeed_config}; the classifier's step executed {where} as rank 0, ResNet-50 + ZeRO + DALI "
        "+ runtime by the planner's formula",
        "",
        f"| memory per rank | mode | executed ({'device' if sweep.on_device else 'dry run'}) | planned "
        "(`instcls plan`) | paper (V100-32GB) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        paper = row["cap_gib"] == 32
        for mode in ("ddp", "dhp"):
            lines.append(f"| {row['cap_gib']:g} GiB | {mode.upper()} | {_millions(row[f'{mode}_executed'])} | "
                         f"{_millions(row[f'{mode}_planned'])} | {_millions(PAPER[mode]) if paper else '-'} |")
        lines.append(f"| {row['cap_gib']:g} GiB | DHP / DDP | {_ratio(row['dhp_executed'], row['ddp_executed'])} | "
                     f"{_ratio(row['dhp_planned'], row['ddp_planned'])} | "
                     f"{_ratio(PAPER['dhp'], PAPER['ddp']) if paper else '-'} |")
    for row in rows:
        if "ddp_step_s" in row:
            lines.append(f"rank 0's step at N={row['ddp_executed']:,} (DDP's largest at {row['cap_gib']:g} GiB), "
                         f"device work only: DDP {row['ddp_step_s']:.4f} s, DHP {row['dhp_step_s']:.4f} s")
    return "\n".join(lines)
