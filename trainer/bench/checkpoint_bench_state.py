"""The synthetic state of `instcls bench checkpoint`: one job rank's share, as the real entries.

Values follow from positions (row ``i`` of W is ``i + d / 1024`` along D, its momentum the
negative; backbone value ``i`` of copy ``c`` is ``c + i * 1e-7``), so any layout's share is known
without the others' and every load is checked exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.checkpoint.checkpoint_files import MODEL_FILE, OPTIMIZER_FILE, read_trainer_meta
from trainer.checkpoint.components import FieldsState
from trainer.checkpoint.rng_state import RngState
from trainer.checkpoint.safe_load import load_data
from trainer.checkpoint.save_plan import FileWrite, HostBuffers
from trainer.parallel.sharded_state import ShardedRows


def _rows(start: int, end: int, dim: int, device: torch.device) -> torch.Tensor:
    index = torch.arange(start, end, dtype=torch.float64, device=device)[:, None]
    return (index + torch.arange(dim, dtype=torch.float64, device=device) / 1024).float()


def _backbone(copies: int, start: int, end: int) -> torch.Tensor:
    values = torch.arange(start, end, dtype=torch.float64).mul_(1e-7)
    return torch.stack([(values + copy).float() for copy in range(copies)])


class BenchClassifier:
    """A classifier shard's checkpoint state, as the instance objective's: W and momentum rows."""

    def __init__(self, weight: torch.Tensor, momentum: torch.Tensor, start: int, total: int) -> None:
        self.weight, self.momentum, self.start, self.total = weight, momentum, start, total

    def state_dict(self) -> dict:
        end = self.start + self.weight.shape[0]
        return {"weight": ShardedRows(self.weight, self.start, end, self.total),
                "momentum": ShardedRows(self.momentum, self.start, end, self.total), "epoch": 0}

    def load_state_dict(self, state: dict) -> None:
        self.weight.copy_(state["weight"].rows)  # read in place already: a copy onto itself
        self.momentum.copy_(state["momentum"].rows)


class BenchEngine:
    """The engine entry's files: this rank's ZeRO partition (DeepSpeed's file) and, on rank 0, the
    consolidated ``model.pt`` and ``optimizer.pt`` (host copies made for each save, where the real
    entry's gather puts them)."""

    def __init__(self, partition: torch.Tensor, start: int, full: torch.Tensor | None) -> None:
        self.partition, self.start, self.full = partition, start, full
        self.buffers = HostBuffers()

    def snapshot(self, path: Path, dims, step: int):
        plan = [FileWrite(f"deepspeed/state/zero_pp_rank_{dims.rank}_optim_states.pt", {"partition": self.partition})]
        if self.full is not None:
            plan += [FileWrite(MODEL_FILE, {"weights": self.buffers.copy("weights", self.full[0])}, owned=True),
                     FileWrite(OPTIMIZER_FILE, {"moments": self.buffers.copy("moments", self.full[1:])}, owned=True)]
        return plan

    def load_from(self, path: Path, dims) -> None:
        own = Path(path) / "deepspeed" / "state" / f"zero_pp_rank_{dims.rank}_optim_states.pt"
        if read_trainer_meta(path)["world_size"] == dims.world_size:
            self.partition.copy_(load_data(own, map_location="cpu")["partition"])
            return
        # another world size: every rank reads the consolidated files and takes its part
        weights = load_data(Path(path) / MODEL_FILE, map_location="cpu")["weights"]
        moments = load_data(Path(path) / OPTIMIZER_FILE, map_location="cpu")["moments"]
        end = self.start + self.partition.shape[1]
        self.partition.copy_(torch.cat([weights[None, self.start:end], moments[:, self.start:end]]))


@dataclass
class Position:
    global_step: int = 0


@dataclass
class BenchParts:
    classifier: BenchClassifier
    engine: BenchEngine
    copies: int
    dim: int


def bench_state(settings: dict, classes: int, dims, saved_ranks: int, empty: bool = False):
    """``(checkpoint mapping, parts)`` of this rank when ``saved_ranks`` ranks' shares of a
    ``job_ranks`` job make the whole; ``empty``: zeros to load into."""
    total = classes // settings["job_ranks"] * saved_ranks
    size, rank = dims.world_size, dims.rank
    start = rank * (total // size) + min(rank, total % size)
    end = start + total // size + (rank < total % size)
    copies = 1 + settings["optimizer_states"]
    part = settings["backbone_params"] // settings["job_ranks"]
    if empty:
        weight = torch.zeros(end - start, settings["dim"], device=dims.device)
        momentum, partition, full = torch.zeros_like(weight), torch.zeros(copies, part), None
    else:
        weight = _rows(start, end, settings["dim"], dims.device)
        momentum, partition = -weight, _backbone(copies, rank * part, (rank + 1) * part)
        full = _backbone(copies, 0, settings["backbone_params"]) if rank == 0 else None
    position = Position()
    parts = BenchParts(BenchClassifier(weight, momentum, start, total), BenchEngine(partition, rank * part, full),
                       copies, settings["dim"])
    state = {"trainer": FieldsState(position), "engine": parts.engine, "objective": parts.classifier,
             "rng": RngState(0, position)}
    return state, parts


def check_loaded(parts: BenchParts, dims) -> None:
    """Raise unless every loaded value is the saved one."""
    classifier, engine = parts.classifier, parts.engine
    end = classifier.start + classifier.weight.shape[0]
    expected = _rows(classifier.start, end, parts.dim, classifier.weight.device)
    part_end = engine.start + engine.partition.shape[1]
    if not (torch.equal(classifier.weight, expected) and torch.equal(classifier.momentum, -expected)
            and torch.equal(engine.partition, _backbone(parts.copies, engine.start, part_end))):
        raise AssertionError(f"rank {dims.rank}: the loaded state differs from the saved one")
