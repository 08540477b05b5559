"""`instcls bench ddp-vs-dhp`: the paper's Table 1 / Figure 3 on this machine.

For each mode (DDP: replicated W, DHP: sharded W) the number of classes N grows geometrically
until a step fails to allocate under the per-rank memory cap, then the boundary is bisected.  Each
point runs in fresh processes (so peaks and the cap are per point) and records, per rank, the
outcome, peak memory, and step time split into compute and classifier communication.
DDP's point is the faster of instcls's replicated classifier and torch's ``linear_cross_entropy``
(``trainer.bench.ddp_baseline``), so DHP is compared with the best single-device code a user has.
Outputs in ``--out``: ``points.csv``, ``table.md`` (Table 1), ``memory.png`` (Figure 3),
``summary.json``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from trainer.bench.ddp_baseline import baseline_lines, describe, faster_baseline
from trainer.bench.point_failure import PointFailure
from trainer.bench.settings.ddp_vs_dhp import SweepSettings
from trainer.bench.step_runner import run_steps
from trainer.observability.memory import peak_since, reset_peak
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers
from trainer.planning.memory_cap import apply_memory_cap, is_out_of_memory

GIB = 2**30


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


def measure_point(settings: SweepSettings, mode: str, num_classes: int) -> dict:
    """A point of the sweep: instcls's classifier in ``mode`` (``run_point``); DDP's, with
    ``settings.torch_baseline``, the faster of it and torch's op at the same N (``faster_baseline``)."""
    point = run_point(settings, mode, num_classes)
    if mode == "ddp" and settings.torch_baseline and torch_op_available():
        from trainer.bench.torch_op_point import run_torch_point

        return faster_baseline(point, run_torch_point(settings, num_classes))
    return point


def torch_op_available() -> bool:
    from trainer.bench.torch_op import has_linear_cross_entropy

    return has_linear_cross_entropy()


def run_point(settings: SweepSettings, mode: str, num_classes: int, worker=_point_worker) -> dict:
    """instcls's classifier in ``mode`` at ``num_classes`` on fresh processes."""
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
        point = measure_point(settings, mode, n)
        points.append(point)
        progress(f"{mode:>4} N={n:>12,}: {describe(point)}")
        if point["status"] != "ok":
            fail = n
            break
        fit = n
        n = int(n * settings.growth)
    for _ in range(settings.refine_steps if fit and fail else 0):
        middle = (fit + fail) // 2
        point = measure_point(settings, mode, middle)
        points.append(point)
        progress(f"{mode:>4} N={middle:>12,}: {describe(point)} (refining)")
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
                point = measure_point(settings, mode, common)
                points[mode].append(point)
            if point["status"] == "ok":
                at[mode] = {
                    key: _worst(point, key) for key in ("step_s", "compute_s", "comm_s", "peak_above_baseline_bytes")
                }
        summary["at_largest_common_n"] = dict(num_classes=common, **at)
        ddp_point = next((p for p in points.get("ddp", []) if p["num_classes"] == common and p["status"] == "ok"), {})
        summary["ddp_baseline_at_common_n"] = ddp_point.get("baseline", "instcls")
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
                "baseline",
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
                            point.get("baseline", ""),
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
        + (f", logits cache {settings.logits_cache_bytes / GIB:g} GiB/rank" if settings.logits_cache_bytes else "")
        + _torch_note(settings),
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
        if best.get("baseline"):
            label = f"DDP (replicated W, {best['baseline']})"
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
    return "\n".join(lines + baseline_lines(points["ddp"]))


def _torch_note(settings: SweepSettings) -> str:
    """What DDP's code is, in the table's title."""
    if not settings.torch_baseline:
        return ""
    if not torch_op_available():
        import torch

        return f"; DDP is instcls's alone (torch {torch.__version__} has no linear_cross_entropy)"
    return f"; DDP: the faster of instcls and torch's linear_cross_entropy ({','.join(settings.torch_settings)})"


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
        points.append(measure_point(settings, mode, n))
        progress(f"{mode:>4} N={n:>12,}: {describe(points[-1])}")
    return points


def run(settings: SweepSettings, out: Path, progress=print, classes: list[int] | None = None) -> tuple[dict, str]:
    """Sweep both modes to their limits, or (``classes``) measure just those N."""
    if classes:
        points = {mode: fixed_points(settings, mode, classes, progress) for mode in ("ddp", "dhp")}
    else:
        points = {mode: sweep(settings, mode, progress) for mode in ("ddp", "dhp")}
    summary = summarize(settings, points)
    return summary, write_outputs(settings, points, summary, out)
