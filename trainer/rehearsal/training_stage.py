"""The two jobs of the rehearsal: `instance` with the full N-way classifier on 2 nodes x 1 rank
(two `instcls launch` agents joined by a c10d rendezvous, as the Indexed Job's pods are), then the
same run resumed from its last checkpoint on 3 ranks of one agent, which reshards the classifier's
rows and keeps the global batch."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from trainer.parallel.launch import free_port
from trainer.parallel.local_nodes import Rendezvous, start_node, stop_all
from trainer.rehearsal import processes, run_logs
from trainer.rehearsal.processes import INSTCLS, RankMemoryWatch
from trainer.rehearsal.settings import REPO, RehearsalSettings
from trainer.rehearsal.shards_stage import directory_bytes

TWO_NODES = "2-nodes"
RESUMED = "resumed"
JOB_TIMEOUT_S = 3 * 3600


def _train_arguments(settings: RehearsalSettings, resume: str, overrides: list[str]) -> list[str]:
    arguments = ["trainer.cli", "train", "--config", str(settings.config), "--resume", resume]
    for setting in [*settings.job_overrides(), *overrides]:
        arguments += ["--set", setting]
    return arguments


def train_on_two_nodes(settings: RehearsalSettings) -> dict:
    """``settings.steps`` steps from scratch, an asynchronous save at ``checkpoint_step`` and a
    blocking one at the end; every path is absolute, as volumes every pod mounts at the same place."""
    checkpoints, logs = settings.two_rank_checkpoints, settings.logs(TWO_NODES)
    for leftover in (checkpoints, logs):  # a stage run again starts afresh
        shutil.rmtree(leftover, ignore_errors=True)
    overrides = [f"data.loader.batch_size={settings.batch_per_rank}", f"max_steps={settings.steps}",
                 f"checkpoint.dir={checkpoints}", f"checkpoint.every_steps={settings.checkpoint_step}",
                 f"logging.dir={logs}"]
    rendezvous = Rendezvous(port=free_port(), nnodes=2, nproc_per_node=1, max_restarts=0)
    arguments = _train_arguments(settings, "none", overrides)
    started, clock = time.time(), time.perf_counter()
    nodes = []
    with RankMemoryWatch() as watch:
        try:
            for index in range(2):
                directory = settings.node_directory(TWO_NODES, index)
                shutil.rmtree(directory, ignore_errors=True)
                nodes.append(start_node(index, directory, rendezvous, arguments, env=processes.rehearsal_env(),
                                        repo=REPO))
                watch.follow(nodes[-1].process.pid)
            deadline = time.monotonic() + JOB_TIMEOUT_S
            for node in nodes:
                try:
                    code = node.wait(max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise processes.fail(f"training, node {node.index} (over {JOB_TIMEOUT_S} s)", node.output_file,
                                         None) from None
                if code != 0:
                    raise processes.fail(f"training, node {node.index}", node.output_file, code)
        finally:
            stop_all(nodes)
    seconds = time.perf_counter() - clock
    read = run_logs.read(logs)
    return {
        "started": started,
        "seconds": seconds,
        "steps": settings.steps,
        "global_batch": settings.global_batch,
        "prior_s": run_logs.objective_ready_s(read) if settings.contrastive_prior else None,
        "step": run_logs.step_seconds(read),
        "rss_at_log_steps": run_logs.rss_at_log_steps(read),
        # The first background save allocates host copies of the rank's state and keeps them for the next
        "rss_before_first_save": run_logs.rss_at_log_steps(read, last_step=settings.checkpoint_step),
        "rss_after_first_save": run_logs.rss_at_log_steps(read, first_step=settings.checkpoint_step + 1),
        "peak_rss": dict(sorted(watch.peak_by_rank.items())),
        "peak_rss_when": _peak_moments(watch, read),
        "saves": {rank: [vars(save) for save in run_logs.saves(read, rank)] for rank in sorted(read.by_rank)},
        "checkpoint_bytes": _newest_checkpoint_bytes(settings.two_rank_checkpoints),
    }


def resume_on_more_ranks(settings: RehearsalSettings) -> dict:
    """The 2-node job's last checkpoint on ``resume_ranks`` ranks of one agent, ``resume_steps``
    more steps, each of them logged so the first step's time is known."""
    origin = _newest_checkpoint(settings.two_rank_checkpoints)
    if origin is None:
        raise processes.StageFailed(f"no complete checkpoint in {settings.two_rank_checkpoints} to resume")
    checkpoints, logs = settings.resumed_checkpoints, settings.logs(RESUMED)
    for leftover in (checkpoints, logs):
        shutil.rmtree(leftover, ignore_errors=True)
    batch = settings.global_batch // settings.resume_ranks
    overrides = [f"data.loader.batch_size={batch}", f"max_steps={settings.steps + settings.resume_steps}",
                 f"checkpoint.dir={checkpoints}", "checkpoint.every_steps=0", f"logging.dir={logs}",
                 "logging.log_every=1"]
    command = [*INSTCLS, "launch", "--standalone", "--nproc-per-node", str(settings.resume_ranks), "-m",
               *_train_arguments(settings, str(origin), overrides)]
    with RankMemoryWatch() as watch:
        finished = processes.run(command, settings.command_output / "train-resumed.txt", "the resumed job",
                                 JOB_TIMEOUT_S, watch)
    read = run_logs.read(logs)
    return {
        "seconds": finished.seconds,
        "from_checkpoint": str(origin),
        "ranks": settings.resume_ranks,
        "batch_per_rank": batch,
        "timeline": run_logs.resume_timeline(read, finished.started),
        "step": run_logs.step_seconds(read, skip_windows=1),
        "peak_rss": dict(sorted(watch.peak_by_rank.items())),
        "peak_rss_when": _peak_moments(watch, read),
        "saves": {rank: [vars(save) for save in run_logs.saves(read, rank)] for rank in sorted(read.by_rank)},
        "checkpoint_bytes": _newest_checkpoint_bytes(checkpoints),
    }


def _peak_moments(watch: RankMemoryWatch, logs) -> dict[int, str]:
    """Each rank's peak RSS placed in its run (the prior, the checkpoint's load, a window of steps,
    the last save)."""
    return {rank: run_logs.moment(logs, watch.peak_reached(rank), rank) for rank in sorted(watch.peak_by_rank)}


def _newest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint (the trainer checks its files again when it loads it)."""
    from trainer.checkpoint.checkpoint_files import complete_checkpoints

    found = complete_checkpoints(directory)
    return found[-1] if found else None


def _newest_checkpoint_bytes(directory: Path) -> int | None:
    newest = _newest_checkpoint(directory)
    return None if newest is None else directory_bytes(newest)
