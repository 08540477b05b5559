"""Drills with a file altered on disk behind the job's back: a checkpoint rewritten to run code
when unpickled, and a training shard cut short after validation."""

from __future__ import annotations

import math
import re
import shutil
import time
from pathlib import Path

import torch

from trainer.checkpoint.checkpoint_files import complete_checkpoints, write_manifest
from trainer.drills.context import FOUR_STEPS, DrillContext, DrillResult
from trainer.drills.jobs import LAUNCH, Job
from trainer.exit_codes import ExitCode


class TouchesAFile:
    """Unpickled with ``weights_only=False`` it creates ``marker``: code run by loading a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def checkpoint_with_pickled_code(context: DrillContext) -> DrillResult:
    job = context.after_two_steps.copy_to(context.directory("checkpoint-with-pickled-code"))
    checkpoint = complete_checkpoints(job.checkpoints)[-1]
    marker = job.run_dir / "code-ran"
    tampered = checkpoint / "components" / "objective" / "rank-00000.pt"
    state = torch.load(tampered, weights_only=True)
    torch.save(dict(state, payload=TouchesAFile(marker)), tampered)
    write_manifest(checkpoint)  # an attacker who can write the volume can rewrite the manifest too
    result = job.run(FOUR_STEPS)
    refused = re.search(r"instcls: error: \S+rank-00000\.pt: refusing to load it", result.stderr) is not None
    return DrillResult(
        "checkpoint-with-pickled-code", "a checkpoint file rewritten to run code when unpickled (manifest too)",
        f"exit {result.returncode}; refused by file name: {refused}; the code ran: {marker.exists()}",
        "none: the checkpoint is left for inspection", None,
        result.returncode != 0 and refused and not marker.exists())


def _job_with_a_damaged_shard(context: DrillContext, name: str) -> tuple[Job, Path]:
    """A job whose training shards have their last tar cut to a third (after validation, as a
    failing disk or a partial copy would)."""
    job = Job(context.directory(name), context.shards)
    job.shards = dict(context.shards, train=job.run_dir / "train-shards")
    shutil.copytree(context.shards["train"], job.shards["train"])
    tar = sorted(job.shards["train"].glob("*.tar"))[-1]
    with open(tar, "r+b") as file:
        file.truncate(tar.stat().st_size // 3)
    return job, tar


def shard_damaged_mid_run(context: DrillContext) -> DrillResult:
    job, tar = _job_with_a_damaged_shard(context, "shard-damaged-mid-run")
    started = time.time()
    result = job.run(FOUR_STEPS, resume="none", timeout=300, launcher=LAUNCH)
    seconds = round(time.time() - started, 1)
    named = re.search(rf"instcls: error: {re.escape(tar.name)} key \d+", result.stderr) is not None
    traceback = 'sample_table.py", line' in result.stderr
    # The reader's rank names the shard; its peer fails after it, on a closed connection.  The job's
    # last line must be the cause, not the peer's traceback or torchrun's report.
    last = (result.stderr.strip().splitlines() or [""])[-1]
    cause_last = re.search(rf"first rank to fail on this node was rank \d: instcls: error: {re.escape(tar.name)} key",
                           last) is not None
    return DrillResult(
        "shard-damaged-mid-run", f"{tar.name} truncated to a third after validation",
        f"exit {result.returncode} after {seconds} s (no hang); one line names shard and key: {named}; "
        f"it is the last line: {cause_last}; traceback: {traceback}",
        "none: nothing was saved from a step that lacked its samples", None,
        result.returncode == ExitCode.BAD_INPUT and named and cause_last and not traceback)


def shard_damaged_skipped(context: DrillContext) -> DrillResult:
    job, tar = _job_with_a_damaged_shard(context, "shard-damaged-skipped")
    result = job.run(FOUR_STEPS + ["data.loader.on_bad_sample=skip"], resume="none")
    skipped = [r for rank in range(job.nproc) for r in job.log_records(rank) if r.get("event") == "bad_sample_skipped"]
    named = bool(skipped) and all(r["problem"].startswith(f"{tar.name} key ") for r in skipped)
    losses = [r["loss"] for r in job.log_records() if r.get("event") == "step"]
    finished = result.returncode == 0 and bool(complete_checkpoints(job.checkpoints))
    return DrillResult(
        "shard-damaged-skipped", f"{tar.name} cut to a third, with data.loader.on_bad_sample=skip",
        f"exit {result.returncode}; trained to the end; each skipped sample named by shard and key: {named}; "
        f"losses finite: {all(math.isfinite(v) for v in losses)}",
        f"the {len(skipped)} unreadable samples (weighed zero in their steps, counted in "
        "instcls_bad_samples_skipped_total)", None,
        finished and named and bool(losses) and all(math.isfinite(v) for v in losses))
