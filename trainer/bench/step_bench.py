"""`instcls bench step`: the training step a user pays for, on whatever device is there.

It runs the real trainer of a job config (the loader, the forward of every view, the objective, the
backward, the optimizers, the checkpoint snapshot when one is due) on ``ranks`` local processes,
on synthetic shards (default) or the config's own, and reports per rank: images/s, and where a
step's time goes (``trainer.observability.step_phases``: the loader's wait, forward, objective,
backward, optimizer, checkpoint; on GPUs from CUDA events, so measuring does not sync the device).
On a GPU it also counts the host syncs of the measured steps (CUDA's sync debug mode).  Before the
steps it measures the loader alone with the same settings, so the table shows the loader's
headroom: the images/s it can feed over the images/s the step consumes.

A synthetic shard set makes the classifier as wide as the set (N = its images); the classifier's
share at a large N needs a shard set of that size (``--shards``), or `instcls dry-run` and
`instcls bench classifier` for the classifier alone.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean, median

import torch

from trainer.bench.data_bench import loader_images_per_second, synthetic_shards
from trainer.dry_run.host_syncs import device_sync_sites
from trainer.parallel.launch import spawn_local_workers

PHASE_ORDER = ("data_wait", "forward", "objective", "backward", "optimizer", "checkpoint")


@dataclass(frozen=True)
class StepBenchSettings:
    """Attributes:
    config: the job config whose step is measured.
    ranks: local processes (one per GPU on a GPU node; CPU ranks otherwise).
    steps: measured steps per rank.
    warmup: steps run first and not measured (start-up, allocator, cuDNN's algorithm search, compiles).
    shards: a shard directory to read (default: synthetic shards of synthetic_count images at
        image_size pixels, written to a temporary directory).
    synthetic_count: images in the synthetic shards (0: one epoch covers warmup + steps + 1).
    image_size: side of the synthetic images on disk.
    loader_only: measure the loader alone and stop.
    """

    config: Path = Path("configs/demo_cpu.yaml")
    ranks: int = 2
    steps: int = 20
    warmup: int = 5
    shards: Path | None = None
    synthetic_count: int = 0
    image_size: int = 64
    loader_only: bool = False


def _job_overrides(shards: Path, work: Path, steps: int) -> list[str]:
    """What the bench changes in the job: its data, a scratch directory, no evaluation or metrics
    endpoint, and a stop after ``steps``."""
    return [f"data.train_shards={shards}", f"data.eval_shards={shards}", f"checkpoint.dir={work / 'checkpoints'}",
            f"logging.dir={work / 'logs'}", "logging.metrics_port=0", "logging.progress=false",
            "eval.knn_at_end=false", "eval.every_epochs=0", "checkpoint.every_epochs=0", f"max_steps={steps}"]


def _loader_images_per_second(config, dims, warmup: int, steps: int) -> float:
    """The training loader alone, on this rank, with the job's settings: images/s after ``warmup``."""
    from data_pipeline.loading.loader import build_loader

    loader = build_loader(config.data.train_shards, config.data.loader, dims.rank, dims.world_size, dims.device,
                          train=True)
    return loader_images_per_second(loader, dims.device, warmup, steps)


def _bench_rank(config_path: Path, overrides: list[str], settings: StepBenchSettings, out: Path) -> None:
    """One rank: the loader alone, then the trainer; its records go to ``out/rank-R.json``."""
    from trainer.config import load_job_config
    from trainer.engine.trainer import Trainer
    from trainer.parallel import init_distributed
    from trainer.parallel.determinism import apply_determinism

    config = load_job_config(config_path, overrides)
    apply_determinism(config.parallel.deterministic)
    dims = init_distributed(config.parallel.classifier_parallel_size, device=config.parallel.device)
    record = dict(rank=dims.rank, device=str(dims.device), batch=config.data.loader.batch_size,
                  loader_images_per_s=_loader_images_per_second(config, dims, settings.warmup, settings.steps))
    if not settings.loader_only:
        trainer = Trainer(config, dims, resume="none")
        trainer.record.step_history, trainer.record.phase_history = [], []
        # On GPUs every synchronizing CUDA call is recorded with its source line; counted at each step's end
        with device_sync_sites() if dims.device.type == "cuda" else nullcontext(None) as sites:
            if sites is not None:
                trainer.record.host_syncs_so_far = lambda: len(sites)
            trainer.train()
        if sites is not None:
            record["sync_sites"] = sites
            torch.cuda.synchronize(dims.device)
            trainer.record.phases_done(trainer.phases.completed())  # the last steps' events
        record.update(steps=trainer.record.step_history, phases=trainer.record.phase_history)
    (out / f"rank-{dims.rank}.json").write_text(json.dumps(record))


def _rank_summary(record: dict, warmup: int) -> dict:
    """One rank's measured steps: images/s, and the mean seconds of each phase per step."""
    summary = dict(rank=record["rank"], device=record["device"], loader_images_per_s=record["loader_images_per_s"])
    if "steps" not in record:
        return summary
    steps = record["steps"][warmup:]
    phases = record["phases"][warmup:]
    seconds = [s["data_wait"] + s["step"] for s in steps]
    summary.update(
        steps=len(steps),
        images_per_s=sum(s["images"] for s in steps) / sum(seconds),
        step_s_mean=fmean(seconds),
        step_s_median=median(seconds),
        phase_s={"data_wait": fmean(s["data_wait"] for s in steps),
                 **{phase: fmean(p.get(phase, 0.0) for p in phases) for phase in PHASE_ORDER[1:]}},
    )
    summary["loader_headroom"] = summary["loader_images_per_s"] / summary["images_per_s"]
    if "host_syncs_so_far" in record["steps"][0]:  # the measured steps' own, not start-up's
        before = record["steps"][warmup - 1]["host_syncs_so_far"]
        summary["host_syncs_per_step"] = (steps[-1]["host_syncs_so_far"] - before) / len(steps)
        measured = record["sync_sites"][before:steps[-1]["host_syncs_so_far"]]
        summary["host_sync_sites_per_step"] = {site: count / len(steps) for site, count in Counter(measured).items()}
    return summary


def run(settings: StepBenchSettings, overrides: list[str] = ()) -> dict:
    """Spawn the ranks, gather their records, summarise each rank."""
    from trainer.config import load_job_config

    config = load_job_config(settings.config, list(overrides))
    total_steps = settings.warmup + settings.steps
    with tempfile.TemporaryDirectory(prefix="instcls-bench-step-") as tmp:
        work = Path(tmp)
        shards = settings.shards
        if shards is None:
            count = settings.synthetic_count or (total_steps + 1) * config.data.loader.batch_size * settings.ranks
            shards = synthetic_shards(work / "shards", count, settings.image_size)
        job = [*overrides, *_job_overrides(shards, work, total_steps)]
        spawn_local_workers(_bench_rank, settings.ranks, settings.config, job, settings, work)
        records = [json.loads((work / f"rank-{rank}.json").read_text()) for rank in range(settings.ranks)]
    ranks = [_rank_summary(record, settings.warmup) for record in records]
    return dict(settings={k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
                overrides=list(overrides), shards=str(settings.shards or "synthetic"), ranks=ranks)


def format_report(result: dict) -> str:
    """One table: a row per rank, the phases in seconds per step and as shares of the step."""
    ranks = result["ranks"]
    first = ranks[0]
    lines = [f"instcls bench step: {result['settings']['config']} on {len(ranks)} rank(s), device {first['device']}, "
             f"shards {result['shards']}"]
    if "images_per_s" not in first:
        lines += [f"rank {r['rank']}: the loader alone feeds {r['loader_images_per_s']:.1f} images/s" for r in ranks]
        return "\n".join(lines)
    header = f"{'rank':>4}{'img/s':>9}{'step s':>9}" + "".join(f"{p:>11}" for p in PHASE_ORDER) + \
        f"{'loader img/s':>14}{'headroom':>10}"
    lines += [f"{first['steps']} measured steps after {result['settings']['warmup']} warm-up; phases in seconds per "
              "step (share of the step)", header]
    for r in ranks:
        cells = "".join(f"{r['phase_s'][p]:>6.3f}({r['phase_s'][p] / r['step_s_mean']:>3.0%})" for p in PHASE_ORDER)
        lines.append(f"{r['rank']:>4}{r['images_per_s']:>9.1f}{r['step_s_mean']:>9.3f}{cells}"
                     f"{r['loader_images_per_s']:>14.1f}{r['loader_headroom']:>9.2f}x")
    if "host_syncs_per_step" in first:
        lines.append("host syncs per measured step (CUDA sync debug mode): " + ", ".join(
            f"rank {r['rank']}: {r['host_syncs_per_step']:.1f}" for r in ranks))
        sites = first["host_sync_sites_per_step"]  # rank 0's
        lines += [f"  {per_step:.1f} per step at {site}" for site, per_step in sites.items()]
    lines.append("img/s: images this rank trained on per second of step (loader wait included); headroom: what "
                 "the loader alone feeds over what the step consumes")
    return "\n".join(lines)
