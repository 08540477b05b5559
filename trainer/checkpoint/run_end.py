"""How a run ended, recorded in its final checkpoint: ``run_end`` in that checkpoint's trainer.json.

A run that trained all its epochs writes ``{"finished": true, "evaluation": STATE}`` there, STATE
being its end-of-run evaluation's: "off" (none configured), "running" (written before it starts: a
job stopped during it leaves this), then "done" or "failed" (with its ``cause``).  trainer.json
is outside the manifest (``checkpoint_files``), and rank 0 replaces it atomically, so the complete
checkpoint stays complete and undamaged however the record is interrupted.

A resume (``--resume auto`` after a restart, or a job started again) of a checkpoint with the
record and no epoch left to train does neither training nor evaluation: it says so in one line
(``finished_run_note``) and the job exits 0.  A failed or unfinished evaluation is not run again
either: one that failed on a finished run would most likely fail again on every restart, so it is
left to `instcls eval knn|linear --checkpoint auto`, which scores the same checkpoint.  A final
checkpoint written before the record existed resumes as it always did, evaluating at its end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.checkpoint.checkpoint_files import TRAINER_FILE, read_trainer_meta

RUN_END_KEY = "run_end"
RESCORE = "`instcls eval knn|linear --checkpoint auto`"


def record_run_end(checkpoint: Path, evaluation: str, cause: str | None = None) -> None:
    """Rank 0: ``checkpoint``'s trainer.json with ``run_end`` set (``evaluation``: "off", "running",
    "done" or "failed", with its ``cause``), written beside it and renamed over it."""
    path = Path(checkpoint) / TRAINER_FILE
    record = {"finished": True, "evaluation": evaluation, **({"cause": cause} if cause else {})}
    meta = dict(read_trainer_meta(checkpoint), **{RUN_END_KEY: record})
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(meta, indent=1))
    os.replace(partial, path)


def finished_run_note(checkpoint: Path | None, meta: dict | None, epochs: int) -> str | None:
    """The line a resume of ``checkpoint`` (``meta``: its trainer.json) says instead of training and
    evaluating, when it is the final checkpoint of a finished run and this job's ``epochs``
    (``optim.epochs``) leave nothing to train; None otherwise (a resume that trains on, or a
    checkpoint without the record)."""
    record = (meta or {}).get(RUN_END_KEY)
    if checkpoint is None or not record or not record.get("finished") or meta["epoch"] < epochs:
        return None
    evaluation = record.get("evaluation")
    outcome = {
        "done": "its end-of-run evaluation ran (the scores are in its logs)",
        "failed": f"its end-of-run evaluation failed ({record.get('cause')}) and is not run again",
        "running": "its end-of-run evaluation did not finish (the job stopped during it) and is not run again",
    }.get(evaluation, "it had no end-of-run evaluation")
    return (f"{checkpoint} is the final checkpoint of a finished run (epoch {meta['epoch']}, step "
            f"{meta['global_step']}): nothing to train; {outcome}; score it with {RESCORE}, or raise "
            "optim.epochs to train on")
