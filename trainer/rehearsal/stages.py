"""The rehearsal's stages in order, each timed, each result kept in ``work_dir/stages/``.

A rehearsal run again with the same settings reuses the results of the stages that finished
before and runs the rest: a failure in the 3-rank resume costs the resume again, not the hour of
ingest and training before it.  A stage's outputs (shards, checkpoints, logs) are what the stages
after it read, so once one stage runs, every stage after it runs too.  ``--fresh`` starts over.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from typing import Callable

from trainer.rehearsal import knn_stage, plan_stage, shards_stage, training_stage
from trainer.rehearsal.settings import RehearsalSettings

STAGES: list[tuple[str, str, Callable[[RehearsalSettings], dict]]] = [
    ("shards", "make-shards: K parts side by side, then merge-shards", shards_stage.write_training_shards),
    ("sample_table", "open the sample table of N ids",
     lambda s: shards_stage.time_sample_table_open(s.train_shards, s.global_batch)),
    ("knn_shards", "make-shards: labelled kNN bank and held-out queries", shards_stage.write_knn_shards),
    ("plan", "instcls plan: predicted memory per rank", plan_stage.plan),
    ("two_nodes", "train on 2 nodes x 1 rank (async checkpoint, final save)", training_stage.train_on_two_nodes),
    ("resume", "resume the last checkpoint on 3 ranks, train a few steps", training_stage.resume_on_more_ranks),
    ("knn", "sharded kNN, trained and random init", knn_stage.knn),
]
WORK_DIR_PARTS = ("shards", "checkpoints", "logs", "nodes", "output", "stages", "report.json", "report.md")


def settings_record(settings: RehearsalSettings) -> dict:
    return {name: str(value) for name, value in asdict(settings).items()}


def clear(settings: RehearsalSettings) -> None:
    """What an earlier rehearsal left in the work dir (only the rehearsal's own parts)."""
    for part in WORK_DIR_PARTS:
        path = settings.work_dir / part
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def run_stages(settings: RehearsalSettings, say=print) -> dict[str, dict]:
    """Every stage's result (``seconds_stage``: its wall time; ``reused``: from an earlier run)."""
    settings.stage_results.mkdir(parents=True, exist_ok=True)
    record = settings_record(settings)
    results: dict[str, dict] = {}
    rerun_from_here = False
    for number, (name, what, stage) in enumerate(STAGES, start=1):
        saved = settings.stage_results / f"{number:02d}-{name}.json"
        if not rerun_from_here and saved.is_file():
            earlier = json.loads(saved.read_text())
            if earlier.get("settings") == record:
                results[name] = dict(earlier["result"], reused=True)
                say(f"[rehearsal] {number}/{len(STAGES)} {what}: reused from an earlier run "
                    f"({earlier['result']['seconds_stage']:.0f} s then)")
                continue
        rerun_from_here = True
        say(f"[rehearsal] {number}/{len(STAGES)} {what} ...")
        started = time.perf_counter()
        result = dict(stage(settings), seconds_stage=time.perf_counter() - started)
        # Through JSON, so that a fresh result reads like a reused one (rank keys become strings).
        result = json.loads(json.dumps(result, default=str))
        results[name] = result
        saved.write_text(json.dumps({"settings": record, "result": result}, indent=1))
        say(f"[rehearsal] {number}/{len(STAGES)} {what}: done in {result['seconds_stage']:.1f} s")
    return results
