"""The JSON log's numbers as TensorBoard scalars (``logging.tensorboard``): a run watched without a
Prometheus server (a laptop, a notebook) still has its curves.

Rank 0 writes them under ``logging.dir/tensorboard/`` through ``torch.utils.tensorboard``: the
scalars of ``trainer.observability.record_sinks.scalars_of`` (``train/loss``, ``eval/knn_trained`` ...).
The ``tensorboard`` package is an optional extra, imported only when the option is on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from trainer.observability.record_sinks import scalars_of

FOLDER = "tensorboard"


def tensorboard_missing(environment_has=importlib.util.find_spec) -> str | None:
    """Why ``logging.tensorboard: true`` cannot run here (the message names the fix), or None."""
    if environment_has("tensorboard") is not None:
        return None
    return ("logging.tensorboard=true needs the tensorboard package, which is not installed: "
            "pip install 'instcls[tensorboard]' (or set logging.tensorboard=false)")


class TensorBoardScalars:
    """Gives each JSON-log record's scalars to a ``SummaryWriter`` writing into ``directory``."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the optional extra: only when the option is on

        self.directory = Path(directory)
        self._writer = SummaryWriter(log_dir=str(self.directory))

    def write(self, record: dict) -> None:
        found = scalars_of(record)
        if found is None:
            return
        step, scalars = found
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step, walltime=record.get("time"))

    def attach(self, path: Path, name: str) -> None:
        """TensorBoard keeps scalars only: the run's files stay in its log folder."""

    def close(self) -> None:
        """Flush the events still queued and close the file (a second close does nothing)."""
        self._writer.close()


def open_tensorboard_scalars(enabled: bool, log_dir: Path, rank: int) -> TensorBoardScalars | None:
    """Rank 0's writer when ``logging.tensorboard`` is on; None on the other ranks or when off."""
    if not enabled or rank != 0:
        return None
    return TensorBoardScalars(Path(log_dir) / FOLDER)
