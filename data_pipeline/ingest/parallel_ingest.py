"""Runs an ingest's shard jobs: all cores, any order, resumable, one part of many if asked.

Each shard's inputs are fixed by the plan before anything is written, so shards are independent
jobs: a process pool writes them in whatever order, and the output is the same for any number of
workers or parts.  A shard whose record exists is skipped, so a killed run (or pod) goes on
where it stopped; a part writes shards ``index, index + count, ...`` and the merge step, once all
parts are done, writes the manifest and the sample table.  The output is a directory, or an
``s3://`` prefix whose shards are written in a local staging directory and uploaded one by one
(``data_pipeline.ingest.s3_ingest``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

from data_pipeline.ingest.ingest_progress import IngestProgress
from data_pipeline.ingest.ingest_state import IngestPlan, Part, finished_record, remove_leftovers
from data_pipeline.shardset.manifest import MANIFEST_NAME, ShardManifest
from data_pipeline.storage.shard_url import S3Url, shard_location

IN_FLIGHT_PER_WORKER = 2  # jobs queued per process: enough to keep it busy, few enough to bound memory


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve_workers(workers: int) -> int:
    if workers < 0:
        raise ValueError(f"--workers {workers}: use a positive number of processes, or 0 for every usable CPU")
    return workers or usable_cpus()


class LocalTarget:
    """A shard set written where it will be read: ``directory``, the output directory."""

    def __init__(self, out_dir: Path) -> None:
        self.directory = Path(out_dir)
        if (self.directory / MANIFEST_NAME).exists():
            raise FileExistsError(f"{self.directory / MANIFEST_NAME} exists: this shard set is complete; write to an "
                                  "empty directory or delete the old shard set")

    def start(self, plan: IngestPlan) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        plan.save_or_check(self.directory)

    def finished(self, numbers: list[int]) -> set[int]:
        return {number for number in numbers if finished_record(self.directory, number) is not None}

    def job_work(self, work: Callable[[object], int]) -> Callable[[object], int]:
        return work

    def merge(self) -> ShardManifest:
        from data_pipeline.ingest.shard_merge import merge_shards

        return merge_shards(self.directory)


def open_target(out, staging: Path | str | None = None):
    """Where an ingest writes: a ``LocalTarget``, or for ``s3://`` an ``s3_ingest.S3Ingest`` (its
    shards written in ``staging`` and uploaded).  Checked now, before a source is listed; a target
    already opened is returned as it is."""
    if not isinstance(out, (str, Path)):
        return out
    location = shard_location(out)
    if isinstance(location, S3Url):
        from data_pipeline.ingest.s3_ingest import S3Ingest

        return S3Ingest(location, staging)
    if staging is not None:
        raise ValueError(f"--staging {staging}: only an s3:// --out is written through a staging directory; "
                         f"{location} is written in place (leave --staging out)")
    return LocalTarget(location)


def run_ingest(target, plan: IngestPlan, part: Part, make_job: Callable[[int], object],
               work: Callable[[object], int], weight: Callable[[int], int], unit: str, workers: int,
               progress: bool, shard_names: Callable[[int], str]) -> ShardManifest | None:
    """Write this part's unfinished shards with ``work(make_job(number))`` into ``target.directory``
    (``open_target``), then merge if this is the only part.  ``weight(number)``: the shard's size in
    ``unit``, for progress and ETA; ``shard_names(number)``: its file name without extension (to
    clear a killed run's leftovers)."""
    target.start(plan)
    mine = list(part.shards(plan.num_shards))
    done = target.finished(mine)
    pending = [number for number in mine if number not in done]
    remove_leftovers(target.directory, [shard_names(number) for number in pending])
    total = sum(weight(number) for number in mine)
    what = "make-shards" if part.count == 1 else f"make-shards part {part}"
    bar = IngestProgress(what, total, total - sum(weight(number) for number in pending), unit, progress)
    try:
        _run_jobs(pending, make_job, target.job_work(work), weight, resolve_workers(workers), bar)
    finally:
        bar.close()
    if part.count == 1:
        return target.merge()
    return None


def _run_jobs(numbers: list[int], make_job, work, weight, workers: int, bar: IngestProgress) -> None:
    if workers == 1 or len(numbers) <= 1:  # no pool: simpler to debug, nothing forked
        for number in numbers:
            work(make_job(number))
            bar.advance(weight(number))
        return
    todo = iter(numbers)
    with ProcessPoolExecutor(workers) as pool:
        running = {}
        try:
            while True:
                while len(running) < workers * IN_FLIGHT_PER_WORKER:
                    number = next(todo, None)
                    if number is None:
                        break
                    running[pool.submit(work, make_job(number))] = number
                if not running:
                    return
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    number = running.pop(future)
                    future.result()  # a worker's error (a bad image under --on-bad-image error) ends the run
                    bar.advance(weight(number))
        except BaseException:
            # Shards already being written finish and keep their records (a rerun skips them).
            for future in running:
                future.cancel()
            raise
