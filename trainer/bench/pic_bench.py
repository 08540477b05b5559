"""`instcls bench pic`: PIC's per-step cost does not grow with N; the full softmax's does.

For each N (one rank holding every row, the harshest layout), in a fresh process each:

* **PIC**: the ``pic`` objective with recent-negative sampling (batch + K recent ids) and its rows in
  a row store (``disk`` by default: memory-mapped files).  Random batch ids each step, so every step
  fetches and corrects rows skipped for a long time (the worst case for the store), prefetch on.
  Reported: median step time and the peak *anonymous* RSS above the process's baseline (on a GPU,
  ``max_memory_allocated``), which excludes the mapped store, and the store's size on disk.
* **Full-softmax DHP** at the same N (``trainer.bench.step_runner``, W + gradient + momentum in
  memory, every row scored) under the memory cap, as in the paper's Appendix E: it runs where it
  fits and fails to allocate where it does not.  Its step time is only measured up to
  ``full_max_classes`` (a step is O(N)).

``sizes`` may end in ``max``: the largest N (a multiple of 1M) whose store fits in 90% of the free
space of ``store_dir``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from trainer.bench.settings.pic import PicBenchSettings
from trainer.observability.memory import status_field_bytes

GIB, MIB = 2**30, 2**20


def resolve_sizes(settings: PicBenchSettings, store_dir: Path) -> tuple[list[int], str]:
    """Numbers of classes to run, and a note on the disk limit when ``max`` was asked for."""
    sizes, note = [], ""
    for size in settings.sizes:
        if size != "max":
            sizes.append(int(size))
            continue
        free = shutil.disk_usage(store_dir).free
        largest = int(0.9 * free / settings.row_bytes()) // 1_000_000 * 1_000_000
        note = (f"largest N: {largest:,} = 90% of the {free / GIB:.1f} GiB free in {store_dir} at "
                f"{settings.row_bytes()} B per row (W + momentum + last step)")
        sizes.append(largest)
    return sizes, note


class _AnonPeak:
    """Polls the process's anonymous RSS (the mapped store is file-backed and does not count)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s, self.peak = interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> int:
        return status_field_bytes("RssAnon")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(self.interval_s)

    def __enter__(self):
        self.peak = self.read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())


def _sampled_point(settings: PicBenchSettings, num_classes: int, store_dir: str, result_file: str) -> None:
    from data_pipeline.loading.samplers.base import StepIndices
    from trainer.engine.schedule import set_lr
    from trainer.objectives import ObjectiveContext, OptimSettings, PicConfig, PicObjective, StepViews, View
    from trainer.parallel import single_process_dims

    dims = single_process_dims()
    device = dims.device
    result: dict = {"num_classes": num_classes}
    try:
        start = time.perf_counter()
        objective = PicObjective(
            PicConfig(queue_size=settings.queue, chunk_size=settings.chunk_size, row_store=settings.store,
                      row_store_dir=store_dir),
            ObjectiveContext(dims=dims, num_instances=num_classes, feature_dim=settings.dim, seed=0,
                             optim=OptimSettings(momentum=0.9, weight_decay=1e-4)),
        )
        objective.store.flush()  # the init's dirty pages are on disk before timing (init_s includes it)
        os.sync()
        result["init_s"] = time.perf_counter() - start
        rng = np.random.default_rng(0)
        objective.recent.push(rng.choice(num_classes, settings.queue, replace=False))  # a full queue
        batches = [rng.choice(num_classes, settings.batch, replace=False)[None]
                   for _ in range(settings.warmup + settings.steps + 1)]
        indices = [StepIndices(ids=ids, valid=np.ones_like(ids, dtype=bool)) for ids in batches]
        optimizer, = objective.optimizers()
        times = []
        baseline = _AnonPeak.read()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with _AnonPeak() as peak:
            for step in range(settings.warmup + settings.steps):
                features = torch.randn(2, settings.batch, settings.dim, device=device, requires_grad=True)
                views = [View(features[v], "global", v) for v in range(2)]
                ids = torch.from_numpy(batches[step][0]).to(device)
                began = time.perf_counter()
                set_lr(optimizer, 0.1)
                loss = objective.loss(StepViews(views, ids, torch.ones_like(ids, dtype=torch.bool), settings.batch, 0,
                                                step, plan=indices[step],
                                                next_plan=indices[step + 1])).loss
                loss.backward()
                objective.after_backward()
                optimizer.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if step >= settings.warmup:
                    times.append(time.perf_counter() - began)
        result.update(status="ok", step_s=statistics.median(times), sampled_rows=objective.metrics()["sampled_rows"],
                      peak_anon_bytes=peak.peak - baseline,
                      store_bytes=sum(f.stat().st_size for f in Path(store_dir).rglob("*.bin")))
        if device.type == "cuda":
            result["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    except Exception as error:  # noqa: BLE001 - recorded, the other points still run
        result.update(status="failed", message=str(error)[:300])
    Path(result_file).write_text(json.dumps(result))


def run_sampled(settings: PicBenchSettings, num_classes: int, store_root: Path) -> dict:
    """One PIC point in a fresh process; its store is deleted afterwards (it may be tens of GB)."""
    store_dir = store_root / f"store-{num_classes}"
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp, "result.json")
        process = multiprocessing.get_context("spawn").Process(
            target=_sampled_point, args=(settings, num_classes, str(store_dir), str(result_file)))
        process.start()
        process.join()
        result = json.loads(result_file.read_text()) if result_file.exists() else {
            "num_classes": num_classes, "status": "failed", "message": f"exit code {process.exitcode}"}
    shutil.rmtree(store_dir, ignore_errors=True)
    return result


def run_full(settings: PicBenchSettings, num_classes: int) -> dict:
    """Full-softmax DHP under the cap; where it would fit but a step takes too long
    (beyond ``full_max_classes``) it is not run."""
    from trainer.bench.ddp_vs_dhp import SweepSettings, run_point
    from trainer.planning import PlanInput, total

    need = total(PlanInput(mode="dhp", num_classes=num_classes, ranks=1, batch=settings.batch, dim=settings.dim,
                           chunk_size=settings.chunk_size, device="cpu"))
    result = {"num_classes": num_classes, "planned_bytes": need}
    if num_classes > settings.full_max_classes and need <= settings.cap_gib * GIB:
        return result | {"status": "not run", "message": "fits, but a step is O(N): raise --full-max-classes"}
    sweep = SweepSettings(ranks=1, batch=settings.batch, dim=settings.dim, chunk_size=settings.chunk_size,
                          cap_gib=settings.cap_gib, steps=1, warmup=0)
    point = run_point(sweep, "dhp", num_classes)
    rank = point["ranks"][0] if point["ranks"] else {}
    return result | {"status": point["status"], "step_s": rank.get("step_s"),
                     "peak_bytes": rank.get("peak_above_baseline_bytes"), "message": rank.get("message", "")}


@dataclass
class PicBenchReport:
    settings: PicBenchSettings
    disk_note: str
    sampled: list[dict] = field(default_factory=list)
    full: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        ok = [p for p in self.sampled if p["status"] == "ok"]
        out: dict = {}
        if len(ok) >= 2:
            first, last = ok[0], ok[-1]
            out["memory_growth"] = last["peak_anon_bytes"] / first["peak_anon_bytes"]
            out["step_time_ratio"] = last["step_s"] / first["step_s"]
            out["from_to"] = [first["num_classes"], last["num_classes"]]
        for pic, full in zip(self.sampled, self.full):
            if pic["status"] == "ok" and full["status"] == "ok" and full.get("step_s"):
                out.setdefault("full_over_pic_step_time", {})[pic["num_classes"]] = full["step_s"] / pic["step_s"]
        return out


def run(settings: PicBenchSettings, progress=print) -> PicBenchReport:
    with tempfile.TemporaryDirectory(prefix="instcls-pic-bench-") as tmp:
        store_root = Path(settings.store_dir) if settings.store_dir else Path(tmp)
        store_root.mkdir(parents=True, exist_ok=True)
        sizes, note = resolve_sizes(settings, store_root)
        report = PicBenchReport(settings, note)
        for num_classes in sizes:
            pic = run_sampled(settings, num_classes, store_root)
            progress(f"PIC  N={num_classes:>12,}: {_describe(pic)}")
            full = run_full(settings, num_classes)
            progress(f"full N={num_classes:>12,}: {_describe(full)}")
            report.sampled.append(pic)
            report.full.append(full)
    return report


def _describe(point: dict) -> str:
    if point["status"] != "ok":
        return f"{point['status']}: {point.get('message', '')[:120]}"
    memory = point.get("peak_anon_bytes", point.get("peak_bytes"))
    return f"{point['step_s']:.3f} s/step, peak {memory / MIB:,.0f} MiB"


def format_report(report: PicBenchReport) -> str:
    s = report.settings
    lines = [f"bench pic: one rank holds all N rows; batch {s.batch} x 2 views, K={s.queue:,} recent ids, D={s.dim}, "
             f"store={s.store}; full softmax capped at {s.cap_gib:g} GiB",
             "| N | PIC s/step | PIC peak anon MiB | store GiB | store init s | full DHP s/step | full DHP peak MiB |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for pic, full in zip(report.sampled, report.full):
        if pic["status"] == "ok":
            pic_cells = (
                f"{pic['step_s']:.3f} | {pic['peak_anon_bytes'] / MIB:,.0f} | {pic['store_bytes'] / GIB:.1f} | "
                f"{pic['init_s']:.0f}"
            )
        else:
            pic_cells = f"{pic['status']} | | |"
        if full["status"] == "ok":
            full_cells = f"{full['step_s']:.3f} | {full['peak_bytes'] / MIB:,.0f}"
        elif full["status"] == "oom":
            full_cells = f"OOM | needs {full['planned_bytes'] / GIB:.1f} GiB (plan) > {s.cap_gib:g} GiB"
        else:
            full_cells = f"{full['status']} | {full.get('message', '')[:60]}"
        lines.append(f"| {pic['num_classes']:,} | {pic_cells} | {full_cells} |")
    summary = report.summary()
    if "memory_growth" in summary:
        a, b = summary["from_to"]
        lines.append(
            f"PIC from N={a:,} to N={b:,}: peak memory x{summary['memory_growth']:.3f} "
            f"(target <= 1.10), step time x{summary['step_time_ratio']:.3f} (target <= 1.2)"
        )
    for n, ratio in summary.get("full_over_pic_step_time", {}).items():
        lines.append(f"N={n:,}: full-softmax step / PIC step = {ratio:.1f}x")
    if report.disk_note:
        lines.append(report.disk_note)
    return "\n".join(lines)


def write_json(report: PicBenchReport, path: Path) -> None:
    path.write_text(
        json.dumps(
            {
                "settings": asdict(report.settings),
                "sampled": report.sampled,
                "full": report.full,
                "summary": report.summary(),
                "disk_note": report.disk_note,
            },
            indent=1,
            default=str,
        )
    )
