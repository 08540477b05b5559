"""`instcls bench step`: the training step a user pays for, on whatever device is there.

It runs the real trainer of a job config (the forward of every view, the objective, the backward,
the optimizers, the checkpoint snapshot when one is due) on ``ranks`` local processes and reports
per rank: images/s, and where a step's time goes (``trainer.observability.step_phases``: the
loader's wait, forward, objective, backward, optimizer, checkpoint; on GPUs from CUDA events, so
measuring does not sync the device).  Per phase it also counts, in one step after the measured
ones, the ops dispatched (``op_counting``: the CPU-measurable stand-in for launch overhead) and, on
CUDA, in one more step the kernels launched (``cuda_kernels``); and, for the job and its baseline
alike, the training thread's waits for the device in the measured steps by phase, with their source
lines: every synchronising call (``DeviceWaitCounter``; on CPU ranks DeepSpeed's accelerator still
makes its calls, so a wait the GPU would pay shows here too), plus on a GPU what CUDA's sync-debug
mode reports (value reads, host copies).

``data``: ``synthetic`` (default) hands the trainer one random batch made once on the device at
every step (``step_feed``), so the loader hides nothing of the step; ``loader`` feeds it through
the job's own loader from synthetic shards (default) or ``--shards``, after measuring the loader
alone, so the table shows the loader's headroom: the images/s it can feed over what the step uses.

``baseline``: the same ranks then run the job's network in a plain PyTorch loop on the same batch
(``step_baseline``: DDP, torch's foreach/fused optimizer kernels, a stand-in loss instead of the
classifier); the table sets the two side by side, with the job's images/s over the baseline's.

A synthetic shard set makes the classifier as wide as the set (N = its images); the classifier's
share at a large N needs a shard set of that size (``--shards``), or `instcls dry-run` and
`instcls bench classifier` for the classifier alone.
"""

from __future__ import annotations

import gc
import json
import tempfile
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from statistics import fmean, median

import torch

from trainer.bench.data_bench import loader_images_per_second, synthetic_shards
from trainer.bench.settings.step import StepBenchSettings
from trainer.bench.step_feed import StepFeed, random_views, synthetic_batch
from trainer.bench.step_instruments import InstrumentedPhases, StepInstruments, profile_step_on
from trainer.dry_run.device_waits import DeviceWaitCounter
from trainer.dry_run.host_syncs import device_sync_sites
from trainer.parallel.launch import spawn_local_workers

PHASE_ORDER = ("data_wait", "forward", "objective", "backward", "optimizer", "checkpoint")
COUNTED_PHASES = PHASE_ORDER[1:]
EXTRA_STEPS = 2  # after the measured steps: one whose ops are counted, one whose CUDA kernels are (CUDA only)


def _job_overrides(shards: Path, work: Path, steps: int) -> list[str]:
    """What the bench changes in the job: its data, a scratch directory, no evaluation or metrics
    endpoint, and a stop after ``steps``."""
    return [f"data.train_shards={shards}", f"data.eval_shards={shards}", f"checkpoint.dir={work / 'checkpoints'}",
            f"logging.dir={work / 'logs'}", "logging.metrics_port=0", "logging.progress=false",
            "eval.knn_at_end=false", "eval.linear_at_end=false", "eval.every_epochs=0", "checkpoint.every_epochs=0",
            f"max_steps={steps}"]


def _loader_images_per_second(config, dims, warmup: int, steps: int) -> float:
    """The training loader alone, on this rank, with the job's settings: images/s after ``warmup``."""
    from data_pipeline.loading.loader import build_loader

    loader = build_loader(config.data.train_shards, config.data.loader, dims.rank, dims.world_size, dims.device,
                          train=True)
    return loader_images_per_second(loader, dims.device, warmup, steps)


def _bench_rank(config_path: Path, overrides: list[str], settings: StepBenchSettings, out: Path) -> None:
    """One rank: the loader alone (``data`` loader), the trainer, the baseline; its records go to
    ``out/rank-R.json``."""
    from trainer.config import load_job_config
    from trainer.parallel import init_distributed
    from trainer.parallel.determinism import apply_determinism

    config = load_job_config(config_path, overrides)
    apply_determinism(config.parallel.deterministic)
    dims = init_distributed(config.parallel.classifier_parallel_size, device=config.parallel.device)
    extra = 2 if dims.device.type == "cuda" else 1  # the op-counted step; on CUDA the profiled one too
    config = replace(config, max_steps=settings.warmup + settings.steps + extra)
    record = dict(rank=dims.rank, device=str(dims.device), batch=config.data.loader.batch_size)
    if settings.data == "loader" or settings.loader_only:
        record["loader_images_per_s"] = _loader_images_per_second(config, dims, settings.warmup, settings.steps)
    if not settings.loader_only:
        views = random_views(config.data.loader.view_layout.sides, config.data.loader.batch_size, dims.device,
                             seed=config.seed + dims.rank)
        record["job"] = _job_run(config, dims, settings, views)
        if settings.baseline:
            gc.collect()  # the trainer's engine, classifier and buffers go before the baseline's are made
            if dims.device.type == "cuda":
                torch.cuda.empty_cache()
            record["baseline"] = _baseline_run(config, dims, settings, views)
    (out / f"rank-{dims.rank}.json").write_text(json.dumps(record))


@contextmanager
def _syncs_recorded(device: torch.device):
    """Every wait of the training thread for the device, recorded with its source line: the synchronising
    calls (``DeviceWaitCounter``: ``torch.cuda.synchronize``, stream and event waits, DeepSpeed's
    accelerator's, which its CPU accelerator makes too) on any device, and on GPUs also what CUDA's
    sync-debug mode reports (value reads, host copies)."""
    if device.type != "cuda":
        sites: list[str] = []
        with DeviceWaitCounter(sink=sites, thread=threading.get_ident()):
            yield sites
        return
    with device_sync_sites() as sites, DeviceWaitCounter(sink=sites, thread=threading.get_ident()):
        yield sites


def _job_run(config, dims, settings: StepBenchSettings, views: list[torch.Tensor]) -> dict:
    """The job's trainer: each step's seconds, its phases' seconds and the instruments' counts.
    With ``data`` synthetic the trainer's loop pulls ``views`` (in the loader's first batch) at
    every step; the trainer itself is unchanged."""
    from trainer.engine.trainer import Trainer

    trainer = Trainer(config, dims, resume="none")
    trainer.record.step_history, trainer.record.phase_history = [], []
    count_step = settings.warmup + settings.steps
    with _syncs_recorded(dims.device) as sites:
        instruments = StepInstruments(count_step, profile_step_on(dims.device, count_step + 1), sites)
        loader = trainer.train_loader
        if settings.data == "synthetic":
            trainer.train_loader = StepFeed.repeating(synthetic_batch(loader, views), loader.steps_per_epoch,
                                                      instruments)
        else:
            trainer.train_loader = StepFeed(loader.epoch_batches, loader.steps_per_epoch, instruments)
        trainer.phases = InstrumentedPhases(trainer.phases, instruments)
        trainer.record.host_syncs_so_far = lambda: len(sites)
        trainer.train()
    run = dict(counts=instruments.summary(settings.measured))
    run["sync_sites"] = sites
    if dims.device.type == "cuda":
        torch.cuda.synchronize(dims.device)
        trainer.record.phases_done(trainer.phases.completed())  # the last steps' events
    run.update(steps=trainer.record.step_history, phases=trainer.record.phase_history)
    return run


def _baseline_run(config, dims, settings: StepBenchSettings, views: list[torch.Tensor]) -> dict:
    """The plain PyTorch loop on the same ranks and ``views``, counted like the job's step."""
    from trainer.bench.step_baseline import PlainStep
    from trainer.engine.deepspeed_setup import load_deepspeed_config

    ds_config = load_deepspeed_config(config.deepspeed_config, config.data.loader.batch_size,
                                      config.optim.clip_grad_norm)
    plain = PlainStep(config, dims, ds_config)
    count_step = settings.warmup + settings.steps
    with _syncs_recorded(dims.device) as sites:
        instruments = StepInstruments(count_step, profile_step_on(dims.device, count_step + 1), sites)
        steps, phases = plain.run(views, config.max_steps, range(settings.warmup, count_step), instruments)
    return dict(steps=steps, phases=phases, counts=instruments.summary(settings.measured), precision=plain.precision)


def _run_summary(run: dict, measured: slice, phase_names: tuple[str, ...]) -> dict:
    """One run's measured steps: images/s, the mean seconds of each phase per step and its share of
    the step, and the instruments' counts per phase."""
    steps, phases = run["steps"][measured], run["phases"][measured]
    seconds = [s["data_wait"] + s["step"] for s in steps]
    step_s = fmean(seconds)
    phase_s = {"data_wait": fmean(s["data_wait"] for s in steps)} if "data_wait" in phase_names else {}
    phase_s.update({phase: fmean(p.get(phase, 0.0) for p in phases) for phase in phase_names if phase != "data_wait"})
    return dict(steps=len(steps), images_per_s=sum(s["images"] for s in steps) / sum(seconds), step_s_mean=step_s,
                step_s_median=median(seconds), phase_s=phase_s,
                phase_share={phase: value / step_s for phase, value in phase_s.items()}, **run["counts"])


def _rank_summary(record: dict, settings: StepBenchSettings) -> dict:
    """One rank: the job's run (and the baseline's, with the job's images/s over its), the loader's headroom."""
    summary = dict(rank=record["rank"], device=record["device"])
    if "loader_images_per_s" in record:
        summary["loader_images_per_s"] = record["loader_images_per_s"]
    if "job" not in record:
        return summary
    job = record["job"]
    summary.update(_run_summary(job, settings.measured, PHASE_ORDER))
    if "loader_images_per_s" in summary:
        summary["loader_headroom"] = summary["loader_images_per_s"] / summary["images_per_s"]
    if "sync_sites" in job:  # the measured steps' own, not start-up's
        steps = job["steps"]
        before = steps[settings.warmup - 1]["host_syncs_so_far"] if settings.warmup else 0
        after = steps[settings.measured][-1]["host_syncs_so_far"]
        summary["host_syncs_per_step"] = (after - before) / settings.steps
        sites = Counter(job["sync_sites"][before:after])
        summary["host_sync_sites_per_step"] = {site: count / settings.steps for site, count in sites.items()}
    if "baseline" in record:
        from trainer.bench.step_baseline import BASELINE_PHASES

        baseline = record["baseline"]
        summary["baseline"] = dict(_run_summary(baseline, settings.measured, BASELINE_PHASES),
                                   precision=baseline["precision"])
        summary["job_over_baseline"] = summary["images_per_s"] / summary["baseline"]["images_per_s"]
    return summary


def run(settings: StepBenchSettings, overrides: list[str] = ()) -> dict:
    """Spawn the ranks, gather their records, summarise each rank."""
    from trainer.config import load_job_config

    config = load_job_config(settings.config, list(overrides))
    total_steps = settings.warmup + settings.steps + EXTRA_STEPS  # an upper bound: each rank sets its own
    with tempfile.TemporaryDirectory(prefix="instcls-bench-step-") as tmp:
        work = Path(tmp)
        shards = settings.shards
        if shards is None:
            count = settings.synthetic_count or (total_steps + 1) * config.data.loader.batch_size * settings.ranks
            shards = synthetic_shards(work / "shards", count, settings.image_size)
        job = [*overrides, *_job_overrides(shards, work, total_steps)]
        spawn_local_workers(_bench_rank, settings.ranks, settings.config, job, settings, work)
        records = [json.loads((work / f"rank-{rank}.json").read_text()) for rank in range(settings.ranks)]
    ranks = [_rank_summary(record, settings) for record in records]
    return dict(settings={k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
                overrides=list(overrides), shards=str(settings.shards or "synthetic"), ranks=ranks)


def _cell(seconds: float | None, step_s: float) -> str:
    return f"{'-':>11}" if seconds is None else f"{seconds:>6.3f}({seconds / step_s:>3.0%})"


def _count_table(title: str, runs: list[tuple[str, dict | None]]) -> list[str]:
    """A row per run of per-phase counts; "-" where a run has no such phase."""
    lines = [title, f"{'run':<10}" + "".join(f"{p:>11}" for p in COUNTED_PHASES)]
    for label, counts in runs:
        if counts is not None:
            lines.append(f"{label:<10}" + "".join(f"{counts[p]:>11.4g}" if p in counts else f"{'-':>11}"
                                                  for p in COUNTED_PHASES))
    return lines


SYNCS_COUNTED = {False: "waits for the device: synchronize calls, DeepSpeed's accelerator's included",
                 True: "waits for the device and CUDA's sync-debug reports: value reads, host copies"}


def format_report(result: dict) -> str:
    """A row per rank and run (the job's, the baseline's): images/s, the phases in seconds per step and
    as shares of the step; the job's images/s over the baseline's; rank 0's counts per phase."""
    ranks = result["ranks"]
    first = ranks[0]
    settings = result["settings"]
    lines = [f"instcls bench step: {settings['config']} on {len(ranks)} rank(s), device {first['device']}, "
             f"data {settings['data']}, shards {result['shards']}"]
    if "images_per_s" not in first:
        lines += [f"rank {r['rank']}: the loader alone feeds {r['loader_images_per_s']:.1f} images/s" for r in ranks]
        return "\n".join(lines)
    header = f"{'rank':>4} {'run':<9}{'img/s':>9}{'step s':>9}" + "".join(f"{p:>11}" for p in PHASE_ORDER) + \
        f"{'loader img/s':>14}{'headroom':>10}"
    lines += [f"{first['steps']} measured steps after {settings['warmup']} warm-up; phases in seconds per step "
              "(share of the step)", header]
    for r in ranks:
        loader = (f"{r['loader_images_per_s']:>14.1f}{r['loader_headroom']:>9.2f}x" if "loader_headroom" in r
                  else f"{'-':>14}{'-':>10}")
        for label, run in (("job", r), ("baseline", r.get("baseline"))):
            if run is not None:
                cells = "".join(_cell(run["phase_s"].get(p), run["step_s_mean"]) for p in PHASE_ORDER)
                lines.append(f"{r['rank']:>4} {label:<9}{run['images_per_s']:>9.1f}{run['step_s_mean']:>9.3f}{cells}"
                             + (loader if label == "job" else ""))
    if "baseline" in first:
        lines.append("job / baseline images/s: " + ", ".join(f"rank {r['rank']} {r['job_over_baseline']:.2f}x"
                                                           for r in ranks)
                     + f"; baseline: plain PyTorch (DDP, {first['baseline']['precision']}), the stand-in loss as "
                     "its objective, no classifier")
    runs = [("job", first), ("baseline", first.get("baseline"))]
    lines += _count_table("ops dispatched in one step, rank 0 (TorchDispatchMode; a foreach op counts once):",
                          [(label, run and run["kernels"]) for label, run in runs])
    if "cuda_kernels" in first:
        lines += _count_table("CUDA kernels launched in one step, rank 0 (torch.profiler):",
                              [(label, run and run.get("cuda_kernels")) for label, run in runs])
    if "host_syncs" in first:
        counted = SYNCS_COUNTED[first["device"].startswith("cuda")]
        lines += _count_table(f"host syncs per measured step by phase, rank 0 ({counted}):",
                              [(label, run and run.get("host_syncs")) for label, run in runs])
    if "host_syncs_per_step" in first:
        lines.append("job's host syncs per measured step: " + ", ".join(
            f"rank {r['rank']}: {r['host_syncs_per_step']:.1f}" for r in ranks))
        sites = first["host_sync_sites_per_step"]  # rank 0's
        lines += [f"  {per_step:.1f} per step at {site}" for site, per_step in sites.items()]
    lines.append("img/s: images this rank trained on per second of step (loader wait included); headroom: what "
                 "the loader alone feeds over what the step consumes")
    return "\n".join(lines)
