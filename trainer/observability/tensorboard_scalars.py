"""The JSON log's numbers as TensorBoard scalars (``logging.tensorboard``): a run watched without a
Prometheus server (a laptop, a notebook) still has its curves.

Rank 0 writes them under ``logging.dir/tensorboard/`` through ``torch.utils.tensorboard``: every
number of its ``step``, ``eval`` and ``summary`` records, at the record's step, tagged by section and
JSON key, nested keys joined by "/" (``train/loss``, ``train/phase_seconds_per_step/forward``,
``train/memory_bytes/rss``, ``eval/knn_trained``, ``eval/linear_curve/0.1``, ``summary/images``).
The ``tensorboard`` package is an optional extra, imported only when the option is on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# The x axis of each event's scalars: its "step", or for the summary its "steps" (the last step).
SECTIONS = {"step": "train", "eval": "eval", "summary": "summary"}
NOT_SCALARS = ("time", "event", "step")  # the wall clock (TensorBoard's own), the kind, the x axis
FOLDER = "tensorboard"


def tensorboard_missing(environment_has=importlib.util.find_spec) -> str | None:
    """Why ``logging.tensorboard: true`` cannot run here (the message names the fix), or None."""
    if environment_has("tensorboard") is not None:
        return None
    return ("logging.tensorboard=true needs the tensorboard package, which is not installed: "
            "pip install 'instcls[tensorboard]' (or set logging.tensorboard=false)")


def scalars_of(record: dict) -> tuple[int, dict[str, float]] | None:
    """``(step, {tag: value})`` of a JSON-log record, or None for events that are not scalars'."""
    section = SECTIONS.get(record.get("event"))
    if section is None:
        return None
    scalars: dict[str, float] = {}
    for key, value in record.items():
        if key not in NOT_SCALARS:
            _collect(f"{section}/{key}", value, scalars)
    return int(record["step"] if "step" in record else record["steps"]), scalars


def _collect(tag: str, value, into: dict[str, float]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _collect(f"{tag}/{key}", item, into)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):  # not None (a skipped step's loss)
        into[tag] = float(value)


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

    def close(self) -> None:
        """Flush the events still queued and close the file (a second close does nothing)."""
        self._writer.close()


def open_tensorboard_scalars(enabled: bool, log_dir: Path, rank: int) -> TensorBoardScalars | None:
    """Rank 0's writer when ``logging.tensorboard`` is on; None on the other ranks or when off."""
    if not enabled or rank != 0:
        return None
    return TensorBoardScalars(Path(log_dir) / FOLDER)
