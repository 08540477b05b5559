"""Checkpoints that survive preemption and changes of world size.

Layout of ``<dir>/step_000001234/`` (written as ``step_000001234.tmp/`` and renamed by rank 0 only
when every rank has finished, so a directory without ``.tmp`` is always complete)::

    trainer.json                    epoch, step, data position, schedule, world layout
    deepspeed/                      DeepSpeed engine state (saved by all ranks)
    model.pt                        consolidated fp32 backbone + head (for eval and resharding)
    classifier/shard-XXXXX.pt       rows [class_start, class_end): weight, SGD momentum, hard negatives
    rng/rank-XXXXX.pt               python / numpy / torch RNG states of each rank

Loading with the same world size restores everything exactly.  With another world size the
classifier rows, their momentum and hard negatives are re-split by class range; the backbone
weights come from ``model.pt`` and its optimizer momentum restarts (logged), because ZeRO
partitions that state by data-parallel rank.  The directory must be on storage every rank sees.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from trainer.classifier import ClassShard, ShardedCosineClassifier
from trainer.parallel import ParallelDims

_NAME = re.compile(r"^step_(\d{9})$")


@dataclass
class TrainerState:
    """Where training stands; ``step_in_epoch`` batches of ``epoch`` are already done."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    hard_negatives_epoch: int = -1  # epoch whose search produced the saved table (-1: none)
    prior_done: bool = False


def _barrier(dims: ParallelDims) -> None:
    if dims.is_distributed:
        dist.barrier(group=dims.control_group)


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not Path(directory).is_dir():
        return []
    found = [p for p in Path(directory).iterdir() if p.is_dir() and _NAME.match(p.name) and (p / "trainer.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_resume(resume: str | None, directory: Path) -> Path | None:
    """``None``/"none" -> start fresh; "auto" -> newest complete checkpoint (or fresh); else a path."""
    if resume in (None, "none"):
        return None
    if resume == "auto":
        found = complete_checkpoints(directory)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "trainer.json").is_file():
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (no trainer.json); use --resume auto")
    return path


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.pt"


def save_checkpoint(
    directory: Path,
    state: TrainerState,
    engine,
    classifier: ShardedCosineClassifier,
    classifier_optimizer: torch.optim.Optimizer,
    hard_negatives: torch.Tensor | None,
    dims: ParallelDims,
    keep: int,
) -> Path:
    """Collective: every rank calls it.  Returns the final path."""
    directory = Path(directory)
    final = directory / f"step_{state.global_step:09d}"
    tmp = final.with_name(final.name + ".tmp")
    if dims.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while saving
        (tmp / "classifier").mkdir(parents=True)
        (tmp / "rng").mkdir()
    _barrier(dims)

    engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):  # no-op below ZeRO-3
        if dims.rank == 0:
            full = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
            torch.save(full, tmp / "model.pt")
    if dims.rank < dims.classifier_parallel_size:  # one copy of each shard (replicas are identical)
        momentum = classifier_optimizer.state.get(classifier.weight, {}).get("momentum_buffer")
        torch.save(
            {
                "class_start": classifier.class_start,
                "class_end": classifier.shard.class_end,
                "num_classes": classifier.config.num_classes,
                "weight": classifier.weight.detach().cpu(),
                "momentum": None if momentum is None else momentum.cpu(),
                "hard_negatives": None if hard_negatives is None else hard_negatives.cpu(),
            },
            tmp / "classifier" / _shard_name(dims.classifier_rank),
        )
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / "rng" / f"rank-{dims.rank:05d}.pt")
    _barrier(dims)

    if dims.rank == 0:
        meta = dict(vars(state), world_size=dims.world_size, classifier_parallel_size=dims.classifier_parallel_size,
                    num_classes=classifier.config.num_classes)
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
        if final.exists():  # the same step from an earlier run started with --resume none
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(directory)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(dims)
    return final


def _load_rows(path: Path, shard: ClassShard, device: torch.device) -> dict[str, torch.Tensor | None]:
    """Rows ``[shard.class_start, shard.class_end)`` of weight / momentum / hard negatives, read
    from however many saved shards overlap them."""
    meta = json.loads((path / "trainer.json").read_text())
    if meta["num_classes"] != shard.num_classes:
        raise ValueError(
            f"{path} holds a {meta['num_classes']}-way classifier but the data has {shard.num_classes} instances; "
            "resume with the shard set the checkpoint was trained on"
        )
    pieces: dict[str, list[torch.Tensor | None]] = {"weight": [], "momentum": [], "hard_negatives": []}
    for index in range(meta["classifier_parallel_size"]):
        saved = ClassShard(shard.num_classes, meta["classifier_parallel_size"], index)
        lo, hi = max(saved.class_start, shard.class_start), min(saved.class_end, shard.class_end)
        if lo >= hi:
            continue
        blob = torch.load(path / "classifier" / _shard_name(index), map_location="cpu", mmap=True, weights_only=True)
        for key in pieces:
            value = blob[key]
            pieces[key].append(None if value is None else value[lo - saved.class_start : hi - saved.class_start])
    return {
        key: None if any(v is None for v in values) else torch.cat(values).to(device)
        for key, values in pieces.items()
    }


def load_checkpoint(
    path: Path,
    engine,
    classifier: ShardedCosineClassifier,
    classifier_optimizer: torch.optim.Optimizer,
    dims: ParallelDims,
    seed: int,
    log=print,
) -> tuple[TrainerState, torch.Tensor | None]:
    """Restore a checkpoint into this run's layout; returns the trainer state and the local
    hard-negative rows (or None)."""
    path = Path(path)
    meta = json.loads((path / "trainer.json").read_text())
    same_world = meta["world_size"] == dims.world_size
    if same_world:
        engine.load_checkpoint(str(path / "deepspeed"), tag="state", load_lr_scheduler_states=False)
    else:
        log(f"resuming {path} written by {meta['world_size']} ranks on {dims.world_size}: classifier re-split by "
            "class range; backbone weights from model.pt, backbone optimizer momentum restarts")
        state_dict = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        parameters = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(parameters, modifier_rank=0):
            if dims.rank == 0 or engine.zero_optimization_stage() < 3:
                engine.module.load_state_dict(state_dict)

    rows = _load_rows(path, classifier.shard, classifier.weight.device)
    with torch.no_grad():
        classifier.weight.copy_(rows["weight"])
    if rows["momentum"] is not None:
        classifier_optimizer.state[classifier.weight]["momentum_buffer"] = rows["momentum"]

    rng_file = path / "rng" / f"rank-{dims.rank:05d}.pt"
    if same_world and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        reseed(seed, meta["global_step"], dims.rank)
    fields = {k: meta[k] for k in vars(TrainerState()) if k in meta}
    return TrainerState(**fields), rows["hard_negatives"]


def reseed(seed: int, step: int, rank: int) -> None:
    """Deterministic RNG state for (seed, step, rank)."""
    mixed = (seed * 1_000_003 + step * 997 + rank) % (2**31)
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)
