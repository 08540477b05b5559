"""What the fault drills share: their result, their inputs (the digits split, an uninterrupted
run to compare with, a run stopped at its step-2 checkpoint) and how a resumed job is judged
against the uninterrupted one.  Jobs train the embedded digits for 4 steps with a checkpoint every 2.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.sources.generated import sklearn_digits
from trainer.checkpoint.checkpoint_files import checkpoint_damage, checkpoint_name, complete_checkpoints
from trainer.drills.jobs import Job, state_difference

CADENCE = ["data.loader.batch_size=64", "optim.epochs=4", "optim.warmup_epochs=1", "checkpoint.every_steps=2",
           "logging.log_every=1", "logging.consumed_ids=true", "parallel.deterministic=true"]
FOUR_STEPS = CADENCE + ["max_steps=4"]
KILLED_AT = re.compile(r"fail point \S+ \(step \d+\): killing rank \d+ with SIGKILL at (\d+\.\d+)")
NO_LOSS = "none: bit-identical to the uninterrupted run"


@dataclass
class DrillResult:
    name: str
    fault: str
    outcome: str
    data_lost: str
    recovery_s: float | None  # from the fault to the first training step after it (or to the clean exit)
    passed: bool


class DrillContext:
    """Shared inputs of the drills, built on first use under ``work_dir``: the digits split, an
    uninterrupted 4-step run, and a run stopped after its step-2 checkpoint."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = Path(work_dir)

    def directory(self, name: str) -> Path:
        path = self.work_dir / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    @cached_property
    def shards(self) -> dict[str, Path]:
        root = self.work_dir / "digits"
        if not (root / "val" / "manifest.json").exists():
            shutil.rmtree(root, ignore_errors=True)
            for split in ("train", "val"):
                write_shards(sklearn_digits(32, split=split), root / split,
                             ShardSettings(prefix=split, samples_per_shard=256), progress=False)
        return {"train": root / "train", "val": root / "val"}

    def _finished_job(self, name: str, overrides: list[str]) -> Job:
        job = Job(self.directory(name), self.shards)
        result = job.run(overrides, resume="none")
        if result.returncode != 0:
            raise RuntimeError(f"the drills' {name} run failed:\n{result.stderr[-3000:]}")
        return job

    @cached_property
    def reference(self) -> Path:
        """The final checkpoint of 4 steps never interrupted."""
        return complete_checkpoints(self._finished_job("uninterrupted", FOUR_STEPS).checkpoints)[-1]

    @cached_property
    def after_two_steps(self) -> Job:
        return self._finished_job("after-two-steps", CADENCE + ["max_steps=2"])


def killed_at(output: str) -> float | None:
    found = KILLED_AT.search(output)
    return float(found.group(1)) if found else None


def first_step_after(job: Job, moment: float | None) -> float | None:
    if moment is None:
        return None
    steps = [r["time"] for r in job.log_records() if r.get("event") == "step" and r["time"] > moment]
    return round(steps[0] - moment, 1) if steps else None


def sigterm_checkpoint(job: Job, output: str) -> Path | None:
    """The checkpoint the SIGTERM stop wrote, if it is complete, before the last step, and no partial
    one was left behind."""
    saving = re.search(r"SIGTERM: saving at step (\d+)", output)
    if saving is None or int(saving.group(1)) >= 4 or list(job.checkpoints.glob("*.tmp")):
        return None
    path = job.checkpoints / checkpoint_name(int(saving.group(1)))
    return path if path in complete_checkpoints(job.checkpoints) and checkpoint_damage(path) is None else None


def recovery_time(job: Job, signalled: float) -> float | None:
    """Seconds from the signal to the first training step of the resumed job (the stopped job's own
    last step comes after the signal too, and does not count)."""
    resumed = [r["time"] for r in job.log_records() if r.get("message", "").startswith("resumed from")]
    first = first_step_after(job, resumed[-1]) if resumed else None
    return None if first is None else round(resumed[-1] + first - signalled, 1)


def resume_and_compare(job: Job, context: DrillContext, fault_time: float | None) -> tuple[str, float | None, bool]:
    resumed = job.run(FOUR_STEPS)
    if resumed.returncode != 0:
        return f"the resume failed: {resumed.stderr[-300:]}", None, False
    difference = state_difference(complete_checkpoints(job.checkpoints)[-1], context.reference)
    return difference or NO_LOSS, first_step_after(job, fault_time), difference is None
