"""Sharded kNN (`instcls eval knn`) of the resumed job's last checkpoint and of the same network at
its random init, on the resumed job's ranks: each rank extracts and keeps its share of the bank,
the held-out queries are all-gathered and the ranks' top-k lists merged.

The training images are noise, so the bank and the queries are labelled digit scenes (the demo's
data, its held-out split as queries).  What the accuracy says is that the path works end to end
(a checkpoint written by 2 ranks, resharded onto 3, read back by the evaluation on 3); a few hundred
steps on noise are not expected to beat the random network at telling digits apart."""

from __future__ import annotations

import re

from trainer.rehearsal import processes
from trainer.rehearsal.processes import INSTCLS, RankMemoryWatch
from trainer.rehearsal.settings import RehearsalSettings

ACCURACY = re.compile(r"accuracy of (\S+): ([\d.]+)%")


def _score(settings: RehearsalSettings, checkpoint: str, name: str) -> dict:
    command = [*INSTCLS, "launch", "--standalone", "--nproc-per-node", str(settings.resume_ranks), "-m",
               "trainer.cli", "eval", "knn", "--config", str(settings.config), "--checkpoint", checkpoint]
    for setting in [*settings.job_overrides(), f"checkpoint.dir={settings.resumed_checkpoints}"]:
        command += ["--set", setting]
    with RankMemoryWatch() as watch:
        finished = processes.run(command, settings.command_output / f"eval-knn-{name}.txt", f"eval knn ({name})",
                                 watch=watch)
    match = ACCURACY.search(finished.output.read_text(errors="replace"))
    if match is None:
        raise processes.fail(f"eval knn ({name}) printed no accuracy", finished.output, 0)
    return {"accuracy": float(match[2]) / 100, "seconds": finished.seconds, "checkpoint": match[1],
            "peak_rss": dict(sorted(watch.peak_by_rank.items()))}


def knn(settings: RehearsalSettings) -> dict:
    return {"ranks": settings.resume_ranks, "trained": _score(settings, "auto", "trained"),
            "random_init": _score(settings, "random-init", "random-init")}
