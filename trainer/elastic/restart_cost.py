"""What a restart cost, from what the run left behind: the steps trained since the checkpoint it
resumes (lost: they are trained again), how long training stood still, and the world size before
and after.  Read by rank 0 from the tails of every rank's JSON log (``logging.dir``), which the
ranks of the run before wrote up to their last step, however they ended (a lost node writes
nothing more; its last logged step is a lower bound of the steps it lost, to within
``logging.log_every``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

TAIL_BYTES = 1 << 20  # the end of each rank's log: a long run's logs are not read whole at every restart


@dataclass(frozen=True)
class RestartCost:
    restarts: int  # resumes of this job so far, this one included
    world_size: int
    previous_world_size: int  # the checkpoint's
    checkpoint_step: int
    last_logged_step: int | None  # the furthest step any rank logged before this start
    steps_lost: int  # trained since the checkpoint, trained again now (0 without a later step logged)
    stopped_seconds: float | None  # from the last step logged before to this resume

    def as_record(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        before, now = self.previous_world_size, self.world_size
        change = f"{before} -> {now} ranks" if before != now else f"{now} ranks, as before"
        stood = f", training stood still {self.stopped_seconds:.1f} s" if self.stopped_seconds is not None else ""
        return (f"restart {self.restarts}: {change}; {self.steps_lost} steps lost since the checkpoint at step "
                f"{self.checkpoint_step}{stood}")


def _tail_records(path: Path) -> list[dict]:
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        file.seek(max(0, size - TAIL_BYTES))
        lines = file.read().splitlines()[1 if size > TAIL_BYTES else 0:]  # the first may be cut
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line a killed rank left half written
            continue
    return records


def last_logged_step(log_dir: Path) -> tuple[int | None, float | None]:
    """``(furthest step any rank logged, when)``: called before this run's first step, so every
    step record is the runs' before."""
    step, when = None, None
    for path in sorted(Path(log_dir).glob("rank-*.jsonl")):
        for record in _tail_records(path):
            if record.get("event") == "step" and (step is None or record["step"] > step):
                step, when = record["step"], record.get("time")
    return step, when


def restart_cost(log_dir: Path, now: float, checkpoint_meta: dict, world_size: int) -> RestartCost:
    """The cost of resuming ``checkpoint_meta``'s checkpoint (its trainer.json) at ``now`` on
    ``world_size`` ranks."""
    checkpoint_step = checkpoint_meta["global_step"]
    last_step, last_time = last_logged_step(log_dir)
    return RestartCost(
        restarts=checkpoint_meta.get("restarts", 0) + 1, world_size=world_size,
        previous_world_size=checkpoint_meta["world_size"], checkpoint_step=checkpoint_step,
        last_logged_step=last_step, steps_lost=max(0, (last_step or 0) - checkpoint_step),
        stopped_seconds=None if last_time is None else round(now - last_time, 1))
