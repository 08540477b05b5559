"""One overlay's job on this machine, set up for a drill: the overlay rendered and resized
(``cpu_substitutions.scale_objects``), its fixtures (the drills' CPU job ConfigMap, NCCL's), the
digits shards on the shard claim, and the job's checkpoints and logs on the checkpoint claim,
where the drills' accounting reads them."""

from __future__ import annotations

from pathlib import Path

from trainer.drills.jobs import Job
from trainer.drills.pods import cpu_substitutions as cpu
from trainer.drills.pods.cpu_job import RUN, job_config_map, nccl_config_map
from trainer.drills.pods.local_cluster import Attempt, LocalCluster
from trainer.drills.pods.manifest import render, workload

DRILL_CONFIG = "configs/digits_cpu.yaml"  # the uninterrupted reference's config
DRILL_SETTINGS = ["logging.progress=false", "eval.knn_at_end=false", "checkpoint.every_epochs=0"]
FIRED = "failpoint-fired"
WAITS = "fail point train.wait_for_sigterm"
# A hang (a rendezvous that never fills, a peer gone mid-collective) ends in this many seconds.
COLLECTIVE_TIMEOUT_S = 60
ELASTIC_BATCH = 64  # per rank at 2 nodes: 128 in all, which 1 and 2 nodes both split


class PodJob(LocalCluster):
    def __init__(self, overlay: str, run_dir: Path, shards: dict[str, Path], settings: list[str]) -> None:
        changes = cpu.Changes()
        objects = render(overlay)
        cpu.scale_objects(objects, changes)
        config_maps = {"instcls-job": job_config_map(DRILL_CONFIG, [*DRILL_SETTINGS, *settings]),
                       "instcls-nccl": nccl_config_map()}
        changes.note("ConfigMap instcls-job", f"the cluster's job config -> {DRILL_CONFIG} with {settings} "
                                              "(k8s/render_configmaps.py)")
        super().__init__(workload(overlay, objects), run_dir, changes, config_maps,
                         claims={"instcls-shards": shards["train"].parent, "instcls-checkpoints": None},
                         collective_timeout_s=COLLECTIVE_TIMEOUT_S, elastic_batch=ELASTIC_BATCH)
        self.overlay, self.shards = overlay, shards

    @property
    def job(self) -> Job:
        """The job's run directory on the checkpoint claim: checkpoints, logs, accounting."""
        return Job(self.shared / "instcls-checkpoints" / RUN, self.shards)

    def arm(self, index: int, failpoint: str, once: str = FIRED, **env: str) -> None:
        """A fault in pod ``index``'s ranks, fired once per job (its replacement runs past it)."""
        self.extra_env[index] = {"INSTCLS_FAILPOINT": failpoint, "INSTCLS_FAILPOINT_ONCE": str(self.shared / once),
                                 **env}
        self.changes.note(f"pod {self.workload.pods[index].name}", f"the drill's fault: INSTCLS_FAILPOINT={failpoint}")

    def held(self, index: int, timeout: float = 300) -> Attempt | None:
        """Pod ``index``'s current attempt once its rank waits at its fail point (None if it never did)."""
        attempt = self.current(index)
        return attempt if attempt.wait_for(WAITS, timeout) else None
