"""Run `instcls train` under torchrun in a subprocess, on the digits shards, into a temp dir, and
read back what its checkpoints hold."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

from trainer.checkpoint.row_checkpoint import read_full_rows, read_metadata
from trainer.drills.jobs import REPO, train_command

__all__ = ["REPO", "train_command", "FAST", "run_train", "latest_checkpoint", "classifier_rows", "step_losses",
           "losses_by_step", "eval_knn", "replica_checks"]


FAST = ["data.loader.batch_size=64", "optim.epochs=4", "optim.warmup_epochs=1", "parallel.deterministic=true"]


def run_train(run_dir: Path, shards, nproc: int, overrides: list[str], resume: str = "none", timeout: int = 600,
              config: str = "digits_cpu.yaml", cwd: Path = REPO):
    """``config``: a name in configs/, or a path of its own (a copied config)."""
    result = subprocess.run(train_command(run_dir, shards, nproc, overrides, resume, config=config), cwd=cwd,
                            capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        raise AssertionError(
            f"training failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    # output to a pipe or a file (a pod log) is plain lines: no bar redrawn with carriage returns
    assert "\r" not in result.stdout + result.stderr, result.stderr[-3000:]
    return result


def latest_checkpoint(run_dir: Path) -> Path:
    found = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_") and "." not in p.name)
    assert found, f"no checkpoint in {run_dir}"
    return found[-1]


def classifier_rows(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Full weight / momentum / hard-negative tables of a checkpoint, put together from the row
    ranges its ranks saved (each row must be saved exactly once, every row by some rank)."""
    folder = checkpoint / "components" / "objective" / "rows"
    if not folder.is_dir():
        return {}
    for key, entry in read_metadata(folder).state_dict_metadata.items():
        chunks = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in entry.chunks)
        assert chunks[0][0] == 0 and chunks[-1][1] == entry.size[0], f"{key}: rows missing"
        for before, after in zip(chunks, chunks[1:]):
            assert before[1] == after[0], f"{key}: rows saved twice or not at all"
    tables = {
        key: rows
        for key, rows in read_full_rows(folder).items()
        if key in ("weight", "momentum", "hard_negatives", "rows")
    }
    if "rows" in tables:  # pic keeps W and momentum side by side, [N, 2, D]
        rows = tables.pop("rows")
        tables["weight"], tables["momentum"] = rows[:, 0], rows[:, 1]
    return tables


def step_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "logs" / "rank-00000.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"event": "step"' in line]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """The logged loss of each step as last trained (a resumed run trains the steps after its
    checkpoint again)."""
    records = [json.loads(line) for line in (run_dir / "logs" / "rank-00000.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("event") == "step"}


def eval_knn(config: str, checkpoint: Path | str, shards, capsys) -> float:
    """`instcls eval knn` of ``checkpoint`` (or "random-init") in this process, on ``shards``: the
    accuracy in % it prints."""
    from trainer.cli import main

    settings = [f"data.train_shards={shards['train']}", f"data.eval_shards={shards['val']}"]
    args = ["eval", "knn", "--config", str(REPO / "configs" / config), "--checkpoint", str(checkpoint)]
    assert main(args + [item for s in settings for item in ("--set", s)]) == 0
    out = capsys.readouterr().out
    return float(out.split(f"kNN (k=20, cosine) accuracy of {checkpoint}: ")[1].split("%")[0])


def replica_checks(run_dir: Path, ranks: int) -> list[list[dict]]:
    """Each rank's ``event: replicated`` records (one per save or evaluation step), after asserting
    that every rank logged the same checks and none found state that differs across ranks."""
    per_rank = []
    for rank in range(ranks):
        lines = (run_dir / "logs" / f"rank-{rank:05d}.jsonl").read_text().splitlines()
        per_rank.append([json.loads(line) for line in lines if '"event": "replicated"' in line])
    assert per_rank[0], "no replicated-state check was logged"
    for checks in per_rank:
        assert [(c["moment"], c["step"]) for c in checks] == [(c["moment"], c["step"]) for c in per_rank[0]]
        assert all(c["diverged"] == [] for c in checks), [c for c in checks if c["diverged"]]
    return per_rank
