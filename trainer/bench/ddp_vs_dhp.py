"""`instcls bench ddp-vs-dhp`: the paper's Table 1 / Figure 3 on this machine.

For each mode (DDP: replicated W, DHP: sharded W) the number of classes N grows geometrically
until a step fails to allocate under the per-rank memory cap, then the boundary is bisected.  Each
point runs in fresh processes (so peaks and the cap are per point) and records, per rank, the
outcome, peak memory, and step time split into compute and classifier communication.
Outputs in ``--out``: ``points.csv``, ``table.md`` (Table 1), ``memory.png`` (Figure 3),
``summary.json``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from trainer.bench.point_failure import PointFailure
from trainer.bench.step_runner import FloatDtype, StepSpec, run_steps
from trainer.observability.memory import peak_since, reset_peak
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers
from trainer.planning.memory_cap import apply_memory_cap, is_out_of_memory

GIB = 2**30


@dataclass(frozen=True)
class SweepSettings:
    """Attributes:
    ranks: T processes.
    batch: global batch.
    dim: feature dim D.
    chunk_size: classes per chunk.
    logits_cache_bytes: logits cache budget per rank (0 recomputes the logits in the backward).
    cap_gib: memory cap per rank (GiB).
    start_classes: the sweep's first N.
    growth: factor from one N to the next until an allocation fails.
    refine_steps: bisection steps between the last fit and the first failure.
    max_classes: the sweep stops here if nothing failed.
    steps: timed steps per point.
    warmup: untimed steps per point.
    dtype: element type of the features, W and the logits.
    update_in_backward: DHP applies SGD inside the backward (W's gradient never materialised).
    backbone: add a real backbone's forward and backward on random images.
    image_size: side of the backbone's random images.
    """

    ranks: int = 2
    batch: int = 256
    dim: int = 128
    chunk_size: int = 65536
    logits_cache_bytes: int = 0
    cap_gib: float = 2.0
    start_classes: int = 100_000
    growth: float = 2.0
    refine_steps: int = 4
    max_classes: int = 2_000_000_000
    steps: int = 1
    warmup: int = 1
    dtype: FloatDtype = "float32"
    update_in_backward: bool = False
    backbone: Literal["resnet18", "resnet50"] | None = None
    image_size: int = 64

    def spec(self, mode: str, num_classes: int) -> StepSpec:
        return StepSpec(num_classes=num_classes, batch=self.batch, dim=self.dim, chunk_size=self.chunk_size,
                        mode=mode, logits_cache_bytes=self.logits_cache_bytes, dtype=self.dtype, steps=self.steps,
                        warmup=self.warmup, update_in_backward=self.update_in_backward and mode == "dhp",
                        backbone=self.backbone, image_size=self.image_size)


def _point_worker(settings: SweepSettings, mode: str, num_classes: int, result_dir: str) -> None:
    """Never raises: a failure is recorded so the other ranks' results still come back.  A peer's
    failure ends this rank's part at once (``PointFailure``) instead of at the collective timeout."""
    dims = init_distributed(timeout_s=120)
    result_file = Path(result_dir, f"rank-{dims.rank:05d}.json")
    result = dict(rank=dims.rank, status="ok", message="")

    def peer_failed(reason: str) -> None:  # on the watcher thread, while this rank is stuck in a collective
        result_file.write_text(json.dumps(dict(result, status="peer_failed", message=f"another rank failed: {reason}")))
        os._exit(0)  # the collective this rank waits in never completes; no teardown can join it

    watch = PointFailure(dims.rank, dims.world_size, peer_failed)
    try:
        run_steps(settings.spec(mode, max(16, settings.ranks)), dims)  # warm the runtime up first
        baseline = reset_peak(dims.device)
        apply_memory_cap(dims.device, int(settings.cap_gib * GIB))
        stats = run_steps(settings.spec(mode, num_classes), dims)
        peak, above = peak_since(dims.device, baseline)
        result.update(step_s=stats.step_s, comm_s=stats.comm_s, compute_s=stats.step_s - stats.comm_s,
                      peak_bytes=peak, peak_above_baseline_bytes=above, num_classes_local=stats.num_classes_local)
    except Exception as error:  # noqa: BLE001 - every failure becomes a recorded outcome
        oom = is_out_of_memory(error)
        result.update(status="oom" if oom else "peer_failed", message=str(error)[:300])
        watch.report(("out of memory: " if oom else "") + str(error)[:200])
        result_file.write_text(json.dumps(result))
        os._exit(0)  # collectives this rank left half-done would block a process group teardown
    watch.finished()
    result_file.write_text(json.dumps(result))


def run_point(settings: SweepSettings, mode: str, num_classes: int, worker=_point_worker) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.suppress(Exception):  # a rank killed outright (no result file) counts as a failed point
            spawn_local_workers(worker, settings.ranks, settings, mode, num_classes, tmp)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank-*.json"))]
    statuses = {r["status"] for r in ranks}
    status = "ok" if statuses == {"ok"} and len(ranks) == settings.ranks else ("oom" if "oom" in statuses else "failed")
    return dict(mode=mode, num_classes=num_classes, status=status, ranks=ranks)


def sweep(settings: SweepSettings, mode: str, progress=print) -> list[dict]:
    """Points of one mode: geometric growth to the first failure, then bisection."""
    points, fit, fail = [], None, None
    n = settings.start_classes
    while n <= settings.max_classes:
        point = run_point(settings, mode, n)
        points.append(point)
        progress(f"{mode:>4} N={n:>12,}: {point['status']}")
        if point["status"] != "ok":
            fail = n
            break
        fit = n
        n = int(n * settings.growth)
    for _ in range(settings.refine_steps if fit and fail else 0):
        middle = (fit + fail) // 2
        point = run_point(settings, mode, middle)
        points.append(point)
        progress(f"{mode:>4} N={middle:>12,}: {point['status']} (refining)")
        fit, fail = (middle, fail) if point["status"] == "ok" else (fit, middle)
    return points


def largest_fit(points: list[dict]) -> int | None:
    fits = [p["num_classes"] for p in points if p["status"] == "ok"]
    return max(fits) if fits else None


def _worst(point: dict, key: str) -> float:
    return max(r[key] for r in point["ranks"])


def summarize(settings: SweepSettings, points: dict[str, list[dict]]) -> dict:
    largest = {mode: largest_fit(p) for mode, p in points.items()}
    common = largest["ddp"]
    summary = dict(settings=asdict(settings), largest_classes=largest,
                   dhp_over_ddp_classes=(largest["dhp"] / largest["ddp"])
                   if largest["ddp"] and largest["dhp"] else None)
    if common:  # both modes at the largest N that DDP fits
        at = {}
        for mode in points:
            point = next((p for p in points[mode] if p["num_classes"] == common and p["status"] == "ok"), None)
            if point is None:
                point = run_point(settings, mode, common)
                points[mode].append(point)
            if point["status"] == "ok":
                at[mode] = {
                    key: _worst(point, key) for key in ("step_s", "compute_s", "comm_s", "peak_above_baseline_bytes")
                }
        summary["at_largest_common_n"] = dict(num_classes=common, **at)
        if "dhp" in at and "ddp" in at:
            summary["dhp_speedup_at_common_n"] = at["ddp"]["step_s"] / at["dhp"]["step_s"]
    return summary


def write_outputs(settings: SweepSettings, points: dict[str, list[dict]], summary: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "points.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "mode",
                "num_classes",
                "status",
                "rank",
                "peak_bytes",
                "peak_above_baseline_bytes",
                "step_s",
                "compute_s",
                "comm_s",
                "message",
            ]
        )
        for mode_points in points.values():
            for point in sorted(mode_points, key=lambda p: p["num_classes"]):
                for r in point["ranks"]:
                    writer.writerow(
                        [
                            point["mode"],
                            point["num_classes"],
                            r["status"],
                            r["rank"],
                            r.get("peak_bytes"),
                            r.get("peak_above_baseline_bytes"),
                            r.get("step_s"),
                            r.get("compute_s"),
                            r.get("comm_s"),
                            r.get("message", ""),
                        ]
                    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    table = format_table(settings, points, summary)
    (out / "table.md").write_text(table + "\n")
    plot_memory(settings, points, out / "memory.png")
    return table


def _largest_ok_point(mode_points: list[dict]) -> dict | None:
    ok = [p for p in mode_points if p["status"] == "ok"]
    return max(ok, key=lambda p: p["num_classes"]) if ok else None


def format_table(settings: SweepSettings, points: dict[str, list[dict]], summary: dict) -> str:
    """Paper Table 1: per method, the largest N trained under the cap and its cost there; then both
    methods side by side at the largest N they both train."""
    cap = f"{settings.cap_gib:g} GiB/rank"
    lines = [
        f"DDP vs DHP, T={settings.ranks} ranks, global batch {settings.batch}, D={settings.dim}, "
        f"chunk {settings.chunk_size}, cap {cap}"
        + (f", backbone {settings.backbone}" if settings.backbone else "")
        + (", DHP updates W inside the backward" if settings.update_in_backward else "")
        + (f", logits cache {settings.logits_cache_bytes / GIB:g} GiB/rank" if settings.logits_cache_bytes else ""),
        "",
        "| method | largest N trained | first N that failed (OOM) | memory/rank there | step there (compute + comm) |",
        "|---|---|---|---|---|",
    ]
    for mode, label in (("ddp", "DDP (replicated W)"), ("dhp", "DHP (sharded W)")):
        fails = [p["num_classes"] for p in points[mode] if p["status"] != "ok"]
        best = _largest_ok_point(points[mode])
        first_fail = f"{min(fails):,}" if fails else "none tried"
        if best is None:
            lines.append(f"| {label} | none | {first_fail} | - | - |")
            continue
        memory = _worst(best, "peak_above_baseline_bytes") / GIB
        step, compute, comm = (_worst(best, key) for key in ("step_s", "compute_s", "comm_s"))
        lines.append(
            f"| {label} | {best['num_classes']:,} | {first_fail} | {memory:.2f} GiB | "
            f"{step:.3f} s ({compute:.3f} + {comm:.3f}) |"
        )
    common = summary.get("at_largest_common_n", {})
    if "ddp" in common and "dhp" in common:
        n = common["num_classes"]
        lines += [
            "",
            f"At N={n:,} (the largest both train): memory/rank DDP "
            f"{common['ddp']['peak_above_baseline_bytes'] / GIB:.2f} GiB vs DHP "
            f"{common['dhp']['peak_above_baseline_bytes'] / GIB:.2f} GiB; step DDP {common['ddp']['step_s']:.3f} s "
            f"vs DHP {common['dhp']['step_s']:.3f} s",
        ]
    if summary.get("dhp_over_ddp_classes"):
        lines.append(
            f"DHP trains {summary['dhp_over_ddp_classes']:.2f}x the classes of DDP "
            f"(target >= {0.9 * settings.ranks:.1f}x = 0.9*T)"
        )
    if summary.get("dhp_speedup_at_common_n"):
        lines.append(
            f"DHP step is {summary['dhp_speedup_at_common_n']:.2f}x faster than DDP at N={common['num_classes']:,}"
        )
    return "\n".join(lines)


def plot_memory(settings: SweepSettings, points: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for mode, colour, label in (("ddp", "tab:red", "DDP"), ("dhp", "tab:blue", "DHP")):
        ok = sorted((p for p in points[mode] if p["status"] == "ok"), key=lambda p: p["num_classes"])
        axis.plot(
            [p["num_classes"] for p in ok],
            [_worst(p, "peak_above_baseline_bytes") / GIB for p in ok],
            "o-",
            color=colour,
            label=f"{label} (peak memory per rank)",
        )
        failed = [p["num_classes"] for p in points[mode] if p["status"] != "ok"]
        if failed:
            axis.plot(
                [min(failed)],
                [settings.cap_gib],
                "x",
                color=colour,
                markersize=12,
                mew=3,
                label=f"{label} OOM at N={min(failed):,}",
            )
    axis.axhline(settings.cap_gib, color="gray", linestyle="--", label=f"cap {settings.cap_gib:g} GiB/rank")
    axis.set_xscale("log")
    axis.set_xlabel("number of classes N")
    axis.set_ylabel("memory per rank (GiB)")
    axis.set_title(f"DDP vs DHP, T={settings.ranks}, batch {settings.batch}, D={settings.dim}")
    axis.legend(fontsize=8)
    axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def fixed_points(settings: SweepSettings, mode: str, classes: list[int], progress=print) -> list[dict]:
    points = []
    for n in classes:
        points.append(run_point(settings, mode, n))
        progress(f"{mode:>4} N={n:>12,}: {points[-1]['status']}")
    return points


def run(settings: SweepSettings, out: Path, progress=print, classes: list[int] | None = None) -> tuple[dict, str]:
    """Sweep both modes to their limits, or (``classes``) measure just those N."""
    if classes:
        points = {mode: fixed_points(settings, mode, classes, progress) for mode in ("ddp", "dhp")}
    else:
        points = {mode: sweep(settings, mode, progress) for mode in ("ddp", "dhp")}
    summary = summarize(settings, points)
    return summary, write_outputs(settings, points, summary, out)
