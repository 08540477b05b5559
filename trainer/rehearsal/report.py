"""The rehearsal's figures as one Markdown table (and the same in ``report.json``), plus each
stage's wall time and the disk used."""

from __future__ import annotations

import json
import time
from pathlib import Path

from trainer.rehearsal.settings import RehearsalSettings
from trainer.rehearsal.shards_stage import directory_bytes
from trainer.rehearsal.stages import STAGES, settings_record

MIB, GIB = 2**20, 2**30


def _mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


def _per_rank(by_rank: dict[str, float], show) -> str:
    return ", ".join(show(by_rank[rank]) for rank in sorted(by_rank, key=int)) or "-"


def _above(peaks: dict[str, int], predicted: int) -> str:
    """Measured minus planned, per rank: the runtime the plan leaves out (Python, torch, DeepSpeed,
    DALI, loader buffers), about the same at any N."""
    return _per_rank(peaks, lambda peak: f"+{(peak - predicted) / MIB:,.0f}")


def _when(job: dict) -> str:
    moments = job.get("peak_rss_when", {})
    return _per_rank(moments, str) if len(set(moments.values())) > 1 else next(iter(moments.values()), "-")


def _stalls(saves: dict[str, list[dict]]) -> tuple[dict[str, float], dict[str, float]]:
    """Each rank's stall and background write time of its (first) asynchronous save."""
    stall, written = {}, {}
    for rank, found in saves.items():
        background = [save for save in found if save["stall_s"] is not None]
        if background:
            stall[rank], written[rank] = background[0]["stall_s"], background[0]["seconds"]
    return stall, written


def _blocking_save_s(saves: dict[str, list[dict]]) -> str:
    last = saves.get("0", [])
    return f"{last[-1]['seconds']:.1f} s" if last and last[-1]["stall_s"] is None else "-"


def figure_rows(settings: RehearsalSettings, results: dict[str, dict]) -> list[tuple[str, str]]:
    shards, table, trained, resumed = results["shards"], results["sample_table"], results["two_nodes"], \
        results["resume"]
    plan, knn, knn_data = results["plan"], results["knn"], results["knn_shards"]
    step, resumed_step, timeline = trained["step"], resumed["step"], resumed["timeline"]
    stall, written = _stalls(trained["saves"])
    prior, dim = trained["prior_s"], plan["two_nodes"]["dim"]
    return [
        ("N (instances = classifier rows), D", f"{settings.images:,}, {dim} (W: {settings.images * dim * 4 / 1e6:,.0f} "
         "MB fp32)"),
        ("ingest: make-shards parts side by side, then merge",
         f"{shards['parts']} parts x 1 worker, {shards['images_per_s']:,.0f} images/s "
         f"({shards['parts_seconds']:.0f} s); merge {shards['merge_seconds']:.1f} s"),
        ("shard set on disk", f"{shards['bytes'] / GIB:.2f} GiB ({settings.image_size} px JPEGs, "
         f"{shards['bytes'] / shards['images']:,.0f} B per image)"),
        ("sample table: open (first / median of 5)",
         f"{table['first_open_s'] * 1e3:.1f} / {table['median_open_s'] * 1e3:.1f} ms ({table['ids']:,} ids, "
         f"{table['table_bytes'] / MIB:.1f} MiB)"),
        ("sample table: one global batch's lookups + reads",
         f"{table['step_lookup_s'] * 1e3:.1f} ms ({table['step_lookup_images']} images)"),
        ("contrastive prior (pass over all N before step 1)",
         f"{prior:.0f} s ({settings.images / prior:,.0f} images/s)" if prior else "off"),
        ("training: 2 nodes x 1 rank", f"{settings.steps} steps of {settings.global_batch} images "
         f"({settings.batch_per_rank} per rank, 2 views), {trained['seconds']:.0f} s in all"),
        ("step time (median / mean)", f"{step['median_s']:.2f} / {step['mean_s']:.2f} s, steps {step['from_step']}-"
         f"{step['to_step']}; {settings.global_batch / step['median_s']:.0f} images/s; data wait "
         f"{100 * step['data_wait_share']:.0f}%"),
        ("peak RSS per rank (VmHWM), MiB", _per_rank(trained["peak_rss"], _mib)),
        ("... reached during", _when(trained)),
        (f"RSS at log steps, largest, MiB: up to step {settings.checkpoint_step} / after its async save",
         f"{_per_rank(trained['rss_before_first_save'], _mib)} / {_per_rank(trained['rss_after_first_save'], _mib)}"),
        ("`instcls plan` per rank (DHP, --cpu), MiB; peak RSS above it",
         f"{_mib(plan['two_nodes']['total'])}; " + _above(trained["peak_rss"], plan["two_nodes"]["total"])),
        (f"async checkpoint at step {settings.checkpoint_step}: step's stall per rank",
         _per_rank(stall, lambda s: f"{s:.2f} s")),
        ("... written in the background in", _per_rank(written, lambda s: f"{s:.1f} s")),
        ("checkpoint size on disk (2 ranks)", f"{trained['checkpoint_bytes'] / GIB:.2f} GiB"),
        (f"final blocking save (step {settings.steps})", _blocking_save_s(trained["saves"])),
        (f"resume onto {resumed['ranks']} ranks ({resumed['batch_per_rank']} per rank): launch to ranks up / "
         "checkpoint loaded / first step done",
         f"{timeline['ranks_up_s']:.1f} / {timeline['checkpoint_loaded_s']:.1f} / {timeline['first_step_s']:.1f} s"),
        (f"step time on {resumed['ranks']} ranks (median)",
         f"{resumed_step['median_s']:.2f} s" if resumed_step else "-"),
        (f"peak RSS per rank on {resumed['ranks']} ranks, MiB", _per_rank(resumed["peak_rss"], _mib)),
        ("... reached during", _when(resumed)),
        (f"`instcls plan` per rank on {resumed['ranks']} ranks, MiB; peak RSS above it",
         f"{_mib(plan['resumed']['total'])}; " + _above(resumed["peak_rss"], plan["resumed"]["total"])),
        (f"resharded save on {resumed['ranks']} ranks (step {settings.steps + settings.resume_steps}), size",
         f"{_blocking_save_s(resumed['saves'])}, {resumed['checkpoint_bytes'] / GIB:.2f} GiB"),
        (f"sharded kNN on {knn['ranks']} ranks (k=20): trained / random init",
         f"{100 * knn['trained']['accuracy']:.2f}% / {100 * knn['random_init']['accuracy']:.2f}% "
         f"({knn_data['query_images']} held-out digit scenes vs a bank of {knn_data['bank_images']:,}; "
         f"{knn['trained']['seconds']:.0f} s)"),
    ]


def stage_rows(results: dict[str, dict]) -> list[tuple[str, str]]:
    rows = []
    for name, what, _ in STAGES:
        result = results[name]
        rows.append((what, f"{result['seconds_stage']:.0f} s" + (" (reused)" if result.get("reused") else "")))
    rows.append(("all stages", f"{sum(r['seconds_stage'] for r in results.values()):.0f} s"))
    return rows


def markdown_table(rows: list[tuple[str, str]], header: tuple[str, str]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def write_report(settings: RehearsalSettings, results: dict[str, dict]) -> str:
    """``report.json`` and ``report.md`` in the work dir; returns the Markdown."""
    disk = {part: directory_bytes(settings.work_dir / part) for part in ("shards", "checkpoints", "logs", "nodes")}
    disk_rows = [(f"disk: {part}", f"{size / GIB:.2f} GiB") for part, size in disk.items()]
    disk_rows.append(("disk: all", f"{sum(disk.values()) / GIB:.2f} GiB"))
    text = "\n\n".join([
        f"ImageNet-1K-sized rehearsal, {time.strftime('%Y-%m-%d %H:%M')}, work dir {settings.work_dir}",
        markdown_table(figure_rows(settings, results), ("figure", "value")),
        markdown_table(stage_rows(results) + disk_rows, ("stage", "wall time / disk")),
    ]) + "\n"
    Path(settings.work_dir / "report.md").write_text(text)
    Path(settings.work_dir / "report.json").write_text(json.dumps(
        {"settings": settings_record(settings), "stages": results, "disk_bytes": disk}, indent=1))
    return text
