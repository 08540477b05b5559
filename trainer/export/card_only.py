"""The model card of a checkpoint alone: what ``instcls export`` writes as ``README.md``, for the
trackers that keep a finished run's files (``logging.mlflow``), without keeping the export."""

from __future__ import annotations

import tempfile
from pathlib import Path

from trainer.export.export_checkpoint import export_checkpoint


def model_card_of(config, checkpoint: Path) -> str:
    with tempfile.TemporaryDirectory(prefix="instcls-card-") as folder:
        return (export_checkpoint(config, Path(checkpoint), Path(folder) / "export") / "README.md").read_text()
