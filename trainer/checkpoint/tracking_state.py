"""The tracker's run in each checkpoint: ``tracking.json`` (``{"mlflow_run_id": ...}``), written by
rank 0, the only rank that talks to the tracker, so that a resume continues the same MLflow run.

A file of its own rather than a field of ``trainer.json``: the trainer's fields are state every
rank holds alike (and a check compares them), while the run's id is known on rank 0 alone, and only
once the server answered."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from trainer.checkpoint.save_plan import FileWrite, SavePlan
from trainer.checkpoint.write_retry import save_json_file

TRACKING_FILE = "tracking.json"


class TrackingState:
    """A ``DirectoryState`` of the checkpoint mapping; ``run_id()``: the MLflow run's id, or None
    (another rank, no tracker, or a run the server has not created yet)."""

    def __init__(self, run_id: Callable[[], str | None]) -> None:
        self.run_id = run_id

    def snapshot(self, path: Path, dims, step: int) -> SavePlan:
        run_id = self.run_id()
        if run_id is None:
            return []
        return [FileWrite(TRACKING_FILE, {"mlflow_run_id": run_id}, owned=True, save=save_json_file)]

    def load_from(self, path: Path, dims) -> None:
        """Nothing to restore: the resumed run reads the id before its tracker starts (``tracked_run_id``)."""


def tracked_run_id(checkpoint: Path | None) -> str | None:
    """The MLflow run a checkpoint's run was tracked in, or None (none, or a checkpoint without one)."""
    if checkpoint is None:
        return None
    try:
        return json.loads((Path(checkpoint) / TRACKING_FILE).read_text()).get("mlflow_run_id")
    except (OSError, ValueError, AttributeError):
        return None
