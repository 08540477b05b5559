"""Run `instcls train` under torchrun in a subprocess, on the digits shards, into a temp dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def train_command(run_dir: Path, shards: dict[str, Path], nproc: int, overrides: list[str], resume: str = "none",
                  launcher: list[str] | None = None):
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
    launcher = launcher or [sys.executable, "-m", "torch.distributed.run"]
    command = [*launcher, "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), "-m", "trainer.cli", "train",
               "--config", str(REPO / "configs" / "demo_cpu.yaml"), "--resume", resume]
    for setting in settings:
        command += ["--set", setting]
    return command


def _free_port() -> int:
    from trainer.parallel.launch import free_port

    return free_port()


def run_train(run_dir: Path, shards, nproc: int, overrides: list[str], resume: str = "none", timeout: int = 600):
    result = subprocess.run(train_command(run_dir, shards, nproc, overrides, resume), cwd=REPO, capture_output=True,
                            text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def latest_checkpoint(run_dir: Path) -> Path:
    found = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_") and "." not in p.name)
    assert found, f"no checkpoint in {run_dir}"
    return found[-1]


def classifier_rows(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Full weight / momentum / hard-negative tables of a checkpoint, concatenated over its shards."""
    meta = json.loads((checkpoint / "trainer.json").read_text())
    shards = [torch.load(checkpoint / "classifier" / f"shard-{i:05d}.pt", weights_only=True)
              for i in range(meta["classifier_parallel_size"])]
    assert shards[0]["class_start"] == 0 and shards[-1]["class_end"] == meta["num_classes"]
    for before, after in zip(shards, shards[1:]):
        assert before["class_end"] == after["class_start"]
    return {key: torch.cat([s[key] for s in shards]) for key in ("weight", "momentum", "hard_negatives")}


def step_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "logs" / "rank-00000.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"event": "step"' in line]
