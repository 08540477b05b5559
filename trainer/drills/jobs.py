"""Real training jobs for the drills (and the tests): `instcls train` under torchrun on CPU ranks,
in a run directory of its own, and what its checkpoints and JSON log hold afterwards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.checkpoint.row_checkpoint import ROWS_FOLDER, read_full_rows
from trainer.observability.report import RunLogs
from trainer.parallel.launch import free_port
from trainer.parallel.local_nodes import LAUNCH  # noqa: F401 (the drills' launcher, named here too)

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def train_arguments(run_dir: Path, shards: dict[str, Path], overrides: list[str], resume: str = "none",
                    config: str = "digits_cpu.yaml") -> list[str]:
    """``trainer.cli train ...`` on ``shards`` ({"train": dir, "val": dir}) with checkpoints and logs
    under ``run_dir``, no progress bars, no end-of-run kNN, checkpoints only where ``overrides`` ask."""
    settings = [
        f"data.train_shards={shards['train']}",
        f"data.eval_shards={shards['val']}",
        f"checkpoint.dir={run_dir / 'checkpoints'}",
        f"logging.dir={run_dir / 'logs'}",
        "logging.progress=false",
        "eval.knn_at_end=false",
        "checkpoint.every_epochs=0",
        *overrides,
    ]
    arguments = ["trainer.cli", "train", "--config", str(REPO / "configs" / config), "--resume", resume]
    for setting in settings:
        arguments += ["--set", setting]
    return arguments


def train_command(run_dir: Path, shards: dict[str, Path], nproc: int, overrides: list[str], resume: str = "none",
                  launcher: list[str] | None = None, config: str = "digits_cpu.yaml") -> list[str]:
    """``train_arguments`` as one torchrun (or `instcls launch`) of ``nproc`` local ranks."""
    return [*(launcher or TORCHRUN), "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
            "-m", *train_arguments(run_dir, shards, overrides, resume, config)]


def job_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


@dataclass
class Job:
    """One run directory of 2-rank jobs on a shard split."""

    run_dir: Path
    shards: dict[str, Path]
    nproc: int = 2

    def command(self, overrides: list[str], resume: str = "auto", launcher: list[str] | None = None) -> list[str]:
        return train_command(self.run_dir, self.shards, self.nproc, overrides, resume, launcher)

    def run(self, overrides: list[str], resume: str = "auto", launcher: list[str] | None = None,
            env: dict[str, str] | None = None, timeout: int = 600, **popen) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(overrides, resume, launcher), cwd=REPO, capture_output=True, text=True,
                              timeout=timeout, env=env or job_env(), **popen)

    def copy_to(self, run_dir: Path) -> "Job":
        shutil.copytree(self.run_dir, run_dir, dirs_exist_ok=True)
        return Job(run_dir, self.shards, self.nproc)

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    def log_records(self, rank: int = 0) -> list[dict]:
        path = self.run_dir / "logs" / f"rank-{rank:05d}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint that training state lives in (``model.pt``, the backbone
    optimizer's ``optimizer.pt``, each component's rank files and rows), flattened to
    ``file.key.path`` names."""
    found: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            found[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)

    optimizer = [checkpoint / "optimizer.pt"] if (checkpoint / "optimizer.pt").exists() else []
    files = [checkpoint / "model.pt", *optimizer, *sorted((checkpoint / "components").rglob("rank-*.pt"))]
    for file in files:
        walk(str(file.relative_to(checkpoint)), torch.load(file, map_location="cpu", weights_only=True))
    for rows in sorted((checkpoint / "components").glob(f"*/{ROWS_FOLDER}")):  # the row-sharded state, whole
        walk(str(rows.relative_to(checkpoint)), read_full_rows(rows))
    return found


def state_difference(checkpoint: Path, reference: Path, same_step: bool = True) -> str | None:
    """None when both checkpoints hold bit-identical training state, else the first difference.
    ``same_step=False`` compares checkpoints of different steps (a dropped step's and the one
    before it): the sampler's position then differs, as it should, and is left out."""
    if same_step and checkpoint.name != reference.name:
        return f"ended at {checkpoint.name}, the reference at {reference.name}"
    mine, theirs = (_training_tensors(path, same_step) for path in (checkpoint, reference))
    if mine.keys() != theirs.keys():
        return f"different state entries: {sorted(mine.keys() ^ theirs.keys())[:3]}"
    for name, tensor in theirs.items():
        if not torch.equal(mine[name], tensor):
            return f"{name} differs from {reference.name}'s"
    return None


def _training_tensors(checkpoint: Path, with_sampler: bool) -> dict[str, torch.Tensor]:
    tensors = checkpoint_tensors(checkpoint)
    return tensors if with_sampler else {k: v for k, v in tensors.items() if not k.startswith("components/sampler")}


def final_run_records(run_dir: Path, event: str) -> dict[int, dict[int, dict]]:
    """step -> {rank: record} of ``event`` records (each naming a ``step``), from the run that logged
    the step last (its ``run`` token), each rank's last record of it.  A restarted job logs the
    steps it repeats again, after the first attempt's lines; the token matters when the restart
    changed the world size: a rank of the run before may have logged a step that the ranks after it
    trained again, split otherwise."""
    logs = RunLogs.read(Path(run_dir) / "logs")
    records = sorted(((record.get("time", 0.0), order, rank, record) for rank in logs.by_rank
                      for order, record in enumerate(logs.events(event, rank))), key=lambda entry: entry[:3])
    final_run = {record["step"]: record.get("run") for *_, record in records}
    steps: dict[int, dict[int, dict]] = {}
    for _, _, rank, record in records:
        if record.get("run") == final_run[record["step"]]:
            steps.setdefault(record["step"], {})[rank] = record
    return steps


def consumed_ids(run_dir: Path) -> dict[int, list[int]]:
    """The instance ids each step of the final training consumed (``logging.consumed_ids``), all
    ranks together, in rank order: the ones its weights hold."""
    return {step: [i for rank in sorted(by_rank) for i in by_rank[rank]["ids"]]
            for step, by_rank in sorted(final_run_records(run_dir, "consumed").items())}


def accounting_difference(run_dir: Path, reference_dir: Path) -> tuple[str | None, int]:
    """``(first problem or None, ids counted)``: every id the final training consumed, consumed
    exactly once and exactly as in the uninterrupted run, step by step."""
    mine, theirs = consumed_ids(run_dir), consumed_ids(reference_dir)
    if not theirs:
        return "the uninterrupted run logged no consumed ids (logging.consumed_ids=true)", 0
    if sorted(mine) != sorted(theirs):
        return f"steps consumed: {sorted(mine)}, uninterrupted: {sorted(theirs)}", 0
    for step, ids in theirs.items():
        if sorted(mine[step]) != sorted(ids):
            return f"step {step} consumed other ids than the uninterrupted run", 0
    everything = [i for ids in mine.values() for i in ids]
    repeated = len(everything) - len(set(everything))
    if repeated:
        return f"{repeated} ids consumed more than once", len(everything)
    return None, len(everything)
