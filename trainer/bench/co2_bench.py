"""`instcls bench classifier --co2`: the step-time overhead of CO2's fused consistency term.

The same DHP classifier step (two global views per image, weights recomputed in the backward) with
``co2_alpha = 0`` (the plain loss) and with CO2's setting, in the same worker processes, the two
variants alternating step by step so both see the same moments of a shared machine; the overhead
is the median of the steps' paired ratios, which one disturbed step cannot move.  Each step's
collectives are counted through the classifier's ``CommTimer``: the term must add none.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from statistics import median

import torch
import torch.distributed as dist

from data_pipeline.loading.view_layout import ViewLayout
from trainer.bench.classifier_bench import ClassifierBenchSettings
from trainer.bench.step_runner import synchronize
from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
from trainer.parallel import init_distributed
from trainer.parallel.host_memory import keep_freed_host_memory
from trainer.parallel.launch import spawn_local_workers

CO2_ALPHA, CO2_TEMPERATURE = 0.3, 0.05  # CO2's MoCo v2 setting
VARIANTS = ("plain", "co2")
TWO_VIEWS = ViewLayout(("global", "global"), (224, 224))  # the sides do not matter here


def _classifier(settings: ClassifierBenchSettings, dims, alpha: float) -> ShardedCosineClassifier:
    return ShardedCosineClassifier(
        ClassifierConfig(num_classes=settings.num_classes, feature_dim=settings.dim, chunk_size=settings.chunk_size,
                         validate_inputs=False, co2_alpha=alpha, co2_temperature=CO2_TEMPERATURE),
        dims, TWO_VIEWS,
    )


def _worker(settings: ClassifierBenchSettings, result_path: str) -> None:
    dims = init_distributed()
    keep_freed_host_memory(dims.device)  # as training does (trainer.parallel.host_memory)
    device, dtype = dims.device, getattr(torch, settings.dtype)
    images = settings.batch // (2 * dims.world_size)  # --batch counts views: two per image
    classifiers = {name: _classifier(settings, dims, CO2_ALPHA if name == "co2" else 0.0) for name in VARIANTS}
    optimizers = {
        name: torch.optim.SGD([c.weight], lr=0.1, momentum=0.9, fused=True) for name, c in classifiers.items()
    }
    generator = torch.Generator(device=device).manual_seed(dims.rank)
    ids = torch.randint(0, settings.num_classes, (images,), device=device, generator=generator).repeat(2)
    features = torch.randn(2 * images, settings.dim, device=device, dtype=dtype, generator=generator).requires_grad_()
    seconds = {name: [] for name in VARIANTS}
    calls = {name: [] for name in VARIANTS}
    for step in range(settings.warmup + settings.steps):
        # Alternate which variant goes first, so neither always follows the other's cache state.
        for name in VARIANTS if step % 2 == 0 else VARIANTS[::-1]:
            classifier = classifiers[name]
            dist.barrier()
            synchronize(device)
            before = classifier.comm_timer.calls
            start = time.perf_counter()
            optimizers[name].zero_grad()
            features.grad = None
            classifier(features, ids).backward()
            optimizers[name].step()
            synchronize(device)
            if step >= settings.warmup:
                seconds[name].append(time.perf_counter() - start)
                calls[name].append(classifier.comm_timer.calls - before)
    result = {name: {"step_s": median(seconds[name]), "collectives_per_step": max(calls[name])} for name in VARIANTS}
    # Each step's pair ran back to back, so their ratio is free of the machine's slower moments.
    result["ratio"] = median(co2 / plain for co2, plain in zip(seconds["co2"], seconds["plain"]))
    gathered: list[dict] = [None] * dims.world_size  # type: ignore[list-item]
    dist.all_gather_object(gathered, result)
    if dims.rank == 0:
        Path(result_path).write_text(json.dumps(gathered))


def run_co2(settings: ClassifierBenchSettings) -> dict:
    if settings.batch % (2 * settings.ranks):
        raise ValueError(f"--batch {settings.batch} must be a multiple of 2 x --ranks (two views per image)")
    settings = settings.on_this_machine()  # the chunk size of this machine's device, unless given
    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "result.json")
        spawn_local_workers(_worker, settings.ranks, settings, result_path)
        ranks = json.loads(Path(result_path).read_text())
    # The slowest rank sets the step time; collective counts are the same on every rank.
    step_s = {name: max(rank[name]["step_s"] for rank in ranks) for name in VARIANTS}
    collectives = {name: max(rank[name]["collectives_per_step"] for rank in ranks) for name in VARIANTS}
    return dict(
        device="cuda" if torch.cuda.is_available() else "cpu",
        step_s=step_s,
        overhead=max(rank["ratio"] for rank in ranks) - 1.0,
        collectives_per_step=collectives,
        collectives_unchanged=collectives["co2"] == collectives["plain"],
    )


def format_co2_report(settings: ClassifierBenchSettings, summary: dict) -> str:
    step_s, calls = summary["step_s"], summary["collectives_per_step"]
    return "\n".join(
        [
            f"CO2 consistency term: N={settings.num_classes:,} B={settings.batch} (two views per image) "
            f"D={settings.dim} T={settings.ranks} chunk={settings.on_this_machine().chunk_size} "
            f"dtype={settings.dtype} on {summary['device']} "
            f"(median of {settings.steps} steps after {settings.warmup} warm-up, variants alternating; worst rank)",
            f"{'loss':<28}{'step s':>8}{'collectives/step':>18}",
            f"{'plain (co2_alpha 0)':<28}{step_s['plain']:>8.3f}{calls['plain']:>18}",
            f"{f'+ CO2 (alpha {CO2_ALPHA}, tau {CO2_TEMPERATURE})':<28}{step_s['co2']:>8.3f}{calls['co2']:>18}",
            f"CO2 overhead: {100 * summary['overhead']:+.1f}% step time "
            "(median of the steps' paired ratios, worst rank; "
            f"target <= {'10' if summary['device'] == 'cuda' else '15'}% on {summary['device']}); collectives "
            f"{'unchanged' if summary['collectives_unchanged'] else 'CHANGED'}",
        ]
    )
