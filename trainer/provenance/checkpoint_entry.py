"""The run's provenance as a checkpoint entry: every checkpoint carries the ``run.json`` of the run
that wrote it (rank 0 writes it; nothing is loaded back: a resumed run records its own)."""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.save_plan import FileWrite, SavePlan
from trainer.checkpoint.write_retry import save_json_file
from trainer.provenance.run_provenance import RUN_FILE


class ProvenanceState:
    """A ``DirectoryState`` of the checkpoint mapping: ``run.json`` beside ``trainer.json``."""

    def __init__(self, provenance: dict | None) -> None:
        self.provenance = provenance  # rank 0's; None on the other ranks

    def snapshot(self, path: Path, dims, step: int) -> SavePlan:
        if self.provenance is None:
            return []
        return [FileWrite(RUN_FILE, self.provenance, owned=True, save=save_json_file)]

    def load_from(self, path: Path, dims) -> None:
        """Nothing to restore: provenance describes a run, and the resumed run writes its own."""
