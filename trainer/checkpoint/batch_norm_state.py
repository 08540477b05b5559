"""Each rank's own BatchNorm running statistics, as a checkpoint entry: ``batch_norm/rank-XXXXX.pt``.

Under ``model.batch_norm: local`` every rank's running statistics follow its own batches, and what
is saved as the network (``model.pt``) is their average over the ranks (``trainer.parallel.batch_norm``).
DeepSpeed's own files keep one copy of the module (rank 0's), so without this entry a resumed rank
would continue from rank 0's statistics instead of its own, and the average saved later would
differ from an uninterrupted run's.  On the same world size each rank gets its own back; on
another, or from a checkpoint written before this entry existed, the statistics stay as the
engine loaded them (``model.pt``'s average on a new world size).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainer.checkpoint.checkpoint_files import rank_file, read_trainer_meta
from trainer.checkpoint.safe_load import load_data
from trainer.checkpoint.save_plan import FileWrite, SavePlan
from trainer.parallel import ParallelDims
from trainer.parallel.batch_norm import running_statistics

BATCH_NORM_FOLDER = "batch_norm"


class BatchNormState:
    """A ``DirectoryState`` of ``module``'s running statistics on this rank."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def snapshot(self, path: Path, dims: ParallelDims, step: int) -> SavePlan:
        statistics = running_statistics(self.module)  # live buffers: the save stages host copies
        return [FileWrite(f"{BATCH_NORM_FOLDER}/{rank_file(dims.rank)}", statistics)] if statistics else []

    def load_from(self, path: Path, dims: ParallelDims) -> None:
        own = Path(path) / BATCH_NORM_FOLDER / rank_file(dims.rank)
        if read_trainer_meta(path)["world_size"] != dims.world_size or not own.is_file():
            return
        saved = load_data(own, map_location="cpu")
        with torch.no_grad():
            for name, buffer in running_statistics(self.module).items():
                buffer.copy_(saved[name])
