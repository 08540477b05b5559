"""Run every variant of the chosen ablations over several seeds as real training jobs
(`instcls train` under torchrun, gloo on CPU ranks), one after the other.

A run is named by a hash of its config, ``WORK/<hash>/``, which holds the exact config it ran
(``config.yaml``), its output, JSON logs and ``result.json``.  A run whose result exists is not
repeated: variants that are the same run (the demo's recipe is the baseline of several ablations)
train once, a sweep that was stopped resumes where it left off, and a document can be rebuilt
without training again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from trainer.ablations.catalogue import ABLATION_EPOCHS, EVAL_EVERY, Ablation, Variant
from trainer.config import ConfigError, apply_overrides, load_job_config
from trainer.drills.jobs import REPO, TORCHRUN, job_env
from trainer.observability.report import RunLogs
from trainer.parallel.launch import free_port

BASE_CONFIG = REPO / "configs" / "demo_cpu.yaml"


@dataclass(frozen=True)
class SweepSettings:
    """Attributes:
    train_shards, val_shards: the digit scenes (unlabelled training split, labelled held-out split).
    work_dir: one directory per run under it.
    (Relative paths are relative to the checkout, where the jobs run: ``repo_relative`` them.)
    seeds: runs per variant, seeds 0 .. seeds-1 (never chosen by outcome).
    nproc: CPU ranks per run.
    overrides: ``section.field=value`` settings for every run (after the sweep's own, before the
        variant's), e.g. fewer steps for a smoke test.
    """

    train_shards: Path
    val_shards: Path
    work_dir: Path = Path("out/ablate")
    seeds: int = 2
    nproc: int = 2
    overrides: tuple[str, ...] = ()
    base_config: Path = BASE_CONFIG


@dataclass
class RunResult:
    """What one run measured: held-out kNN accuracy (fractions) by evaluation epoch and at the end,
    the random-init network's, and its cost."""

    ablation: str
    variant: str
    seed: int
    run: str  # the run's directory name under the work dir (shared by identical variants)
    knn_by_epoch: dict[int, float]
    knn_final: float
    knn_random_init: float
    epochs: int
    images_per_s: float
    wall_seconds: float
    config: dict = field(repr=False, default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> "RunResult":
        data = dict(data, knn_by_epoch={int(epoch): value for epoch, value in data["knn_by_epoch"].items()})
        return cls(**data)


def repo_relative(path: Path) -> Path:
    """``path`` (relative to the current directory) as the jobs see it: relative to the checkout
    when inside it, so a run's config, and the hash that names it, do not depend on where the
    checkout lives; absolute otherwise."""
    path = path.resolve()
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def training_config(settings: SweepSettings, variant: Variant, seed: int) -> dict:
    """The demo's config with the variant's objective, the sweep's settings and the variant's
    overrides applied, in that order (later ones win); no output paths yet."""
    data = yaml.safe_load(settings.base_config.read_text())
    if variant.objective is not None:
        data["objective"] = dict(variant.objective)
    sweep = [
        f"data.train_shards={settings.train_shards}",
        f"data.eval_shards={settings.val_shards}",
        "checkpoint.every_epochs=0",
        "logging.progress=false",
        "logging.metrics_port=0",
        f"optim.epochs={ABLATION_EPOCHS}",
        f"eval.every_epochs={EVAL_EVERY}",
        "eval.knn_at_end=true",
        "eval.linear_at_end=false",
        f"seed={seed}",
        f"data.loader.seed={seed}",  # the augmentations and the data order change with the seed too
    ]
    return apply_overrides(data, [*sweep, *settings.overrides, *variant.overrides])


def run_dir(settings: SweepSettings, config: dict) -> Path:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    return settings.work_dir / digest[:12]


def resolved_config(settings: SweepSettings, variant: Variant, seed: int) -> tuple[dict, Path]:
    """(the run's complete config, its directory): the training config plus where its checkpoints
    and logs go, inside the directory named by the training config's hash."""
    config = training_config(settings, variant, seed)
    directory = run_dir(settings, config)
    paths = [f"checkpoint.dir={directory / 'checkpoints'}", f"logging.dir={directory / 'logs'}"]
    return apply_overrides(config, paths), directory


def write_checked_config(data: dict, path: Path, ablation: Ablation, variant: Variant) -> None:
    """Write the run's config and load it back through the job config's checks, so a wrong
    override fails here, naming the variant, and not inside a launched job."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        load_job_config(path)
    except ConfigError as error:
        raise ConfigError(f"ablation {ablation.name}, variant {variant.label!r}: {error}") from error


def cached_result(directory: Path, config: dict) -> RunResult | None:
    path = directory / "result.json"
    if not path.exists():
        return None
    result = RunResult.from_json(json.loads(path.read_text()))
    return result if result.config == config else None


def measure(directory: Path, ablation: Ablation, variant: Variant, seed: int, config: dict,
            wall_seconds: float) -> RunResult:
    """Read a finished run's results back from its rank-0 log."""
    logs = RunLogs.read(directory / "logs")
    evals = logs.events("eval")
    summaries = logs.summaries()
    if not evals or not summaries:
        raise RuntimeError(f"{directory / 'logs'}: the run finished without an evaluation or a summary")
    return RunResult(
        ablation=ablation.name,
        variant=variant.label,
        seed=seed,
        run=directory.name,
        knn_by_epoch={record["epoch"]: record["knn_trained"] for record in evals},
        knn_final=evals[-1]["knn_trained"],
        knn_random_init=evals[-1]["knn_random_init"],
        epochs=summaries[0]["epochs"],
        images_per_s=logs.images_per_second(),
        wall_seconds=round(wall_seconds, 1),
        config=config,
    )


def run_one(settings: SweepSettings, ablation: Ablation, variant: Variant, seed: int) -> tuple[RunResult, bool]:
    """(result, whether it was already measured) of one variant at one seed."""
    config, configured = resolved_config(settings, variant, seed)
    directory = REPO / configured  # jobs run in the checkout, where relative paths of the config point
    cached = cached_result(directory, config)
    if cached is not None:  # measured before, perhaps as another ablation's variant
        return dataclasses.replace(cached, ablation=ablation.name, variant=variant.label), True
    for stale in ("logs", "checkpoints", "result.json", "train.log"):
        target = directory / stale
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    config_path = directory / "config.yaml"
    write_checked_config(config, config_path, ablation, variant)
    command = [*TORCHRUN, "--nproc-per-node", str(settings.nproc), "--master-port", str(free_port()),
               "-m", "trainer.cli", "train", "--config", str(config_path.resolve()), "--resume", "none"]
    started = time.monotonic()
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=job_env())
    wall = time.monotonic() - started
    (directory / "train.log").write_text(finished.stdout + finished.stderr, encoding="utf-8")
    if finished.returncode != 0:
        tail = "\n".join((finished.stdout + finished.stderr).splitlines()[-15:])
        raise RuntimeError(f"ablation {ablation.name}, variant {variant.label!r}, seed {seed} failed "
                           f"(exit {finished.returncode}); full output in {directory / 'train.log'}:\n{tail}")
    result = measure(directory, ablation, variant, seed, config, wall)
    shutil.rmtree(directory / "checkpoints", ignore_errors=True)  # ~25 MB a run, and nothing reads them
    temporary = directory / "result.json.tmp"
    temporary.write_text(json.dumps(asdict(result), indent=1))
    temporary.replace(directory / "result.json")
    return result, False


def run_sweep(settings: SweepSettings, ablations: tuple[Ablation, ...], report=print) -> list[RunResult]:
    """Every variant of ``ablations`` at every seed; ``report`` gets one line per run."""
    plan = [(ablation, variant, seed) for ablation in ablations for variant in ablation.variants
            for seed in range(settings.seeds)]
    results = []
    for index, (ablation, variant, seed) in enumerate(plan, start=1):
        result, cached = run_one(settings, ablation, variant, seed)
        results.append(result)
        how = f"measured before ({result.run})" if cached else f"{result.wall_seconds:.0f} s ({result.run})"
        report(f"[{index}/{len(plan)}] {ablation.name} / {variant.label} / seed {seed}: kNN "
               f"{100 * result.knn_final:.2f}% (random init {100 * result.knn_random_init:.2f}%), {how}")
    return results
