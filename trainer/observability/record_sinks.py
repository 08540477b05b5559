"""The seam between the run's JSON log and the trackers that mirror it (TensorBoard, MLflow).

Every record the JSON log writes goes to each sink, so a tracker never shows a number the log lacks;
a tracker is one module with ``write``, ``attach`` and ``close``.  ``scalars_of`` turns a record into
the ``(step, {tag: value})`` every tracker plots: every number of the ``step``, ``eval`` and
``summary`` records, at the record's step, tagged by section and JSON key, nested keys joined by "/"
(``train/loss``, ``train/phase_seconds_per_step/forward``, ``train/memory_bytes/rss``,
``eval/knn_trained``, ``eval/linear_curve/0.1``, ``summary/images``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

# The x axis of each event's scalars: its "step", or for the summary its "steps" (the last step).
SECTIONS = {"step": "train", "eval": "eval", "summary": "summary"}
NOT_SCALARS = ("time", "event", "step")  # the wall clock (the tracker's own), the kind, the x axis


class RecordSink(Protocol):
    def write(self, record: dict) -> None:
        """One JSON-log record (with its ``time``), as the log wrote it."""

    def attach(self, path: Path, name: str) -> None:
        """A file of the run (``run.json``, the summary, the model card) under ``name``."""

    def close(self) -> None:
        """Deliver what is queued, within the sink's own bound, and stop (a second close does nothing)."""


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
