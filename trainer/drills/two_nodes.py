"""A 2-rank job as two nodes on one machine (``trainer.parallel.local_nodes``): one `instcls launch`
agent per node, each in its own working directory, reading shards and writing checkpoints and logs
through ``volumes/``, a link each node has to the shared directory, as every pod mounts the same
volumes at the same path.  The job's paths are relative, so each node resolves them against its
own working directory."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.drills.context import FOUR_STEPS
from trainer.drills.jobs import REPO, Job, job_env, train_arguments
from trainer.parallel.launch import free_port
from trainer.parallel.local_nodes import Node, Rendezvous, start_node, stop_all

VOLUMES = "volumes"  # each node's link to the shared directory
FIRED = "failpoint-fired"  # the marker that makes a drill's fault fire once per job (INSTCLS_FAILPOINT_ONCE)


@dataclass
class TwoNodeJob:
    """``run_dir/shared`` is what the pods share; ``run_dir/node-I`` is node I's own directory."""

    run_dir: Path
    shards: dict[str, Path]
    overrides: list[str] = field(default_factory=lambda: list(FOUR_STEPS))
    max_restarts: int = 3
    join_timeout_s: int = 600
    min_nodes: int | None = None  # elastic (--nnodes MIN:2): the job goes on with MIN nodes
    # how long a round with MIN nodes waits for more: elastic jobs must outwait the agents' start-up
    last_call_s: int = 1
    shutdown_timeout_s: int | None = None  # the agents' --shutdown-timeout (None: torch's 30 s)
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rendezvous = Rendezvous(free_port(), nnodes=2, min_nodes=self.min_nodes, nproc_per_node=1,
                                     max_restarts=self.max_restarts, join_timeout_s=self.join_timeout_s,
                                     last_call_s=self.last_call_s, shutdown_timeout_s=self.shutdown_timeout_s)
        (self.shared / "shards").mkdir(parents=True, exist_ok=True)
        for split, path in self.shards.items():
            link = self.shared / "shards" / split
            if not link.exists():
                link.symlink_to(path)
        self.metrics_ports = {node: free_port() for node in (0, 1)}

    @property
    def shared(self) -> Path:
        return self.run_dir / "shared"

    @property
    def job(self) -> Job:
        """The shared directory seen as a one-agent job's run directory: checkpoints, logs, accounting."""
        return Job(self.shared, self.shards)

    def node_directory(self, node: int) -> Path:
        directory = self.run_dir / f"node-{node}"
        directory.mkdir(parents=True, exist_ok=True)
        if not (directory / VOLUMES).exists():
            (directory / VOLUMES).symlink_to(self.shared, target_is_directory=True)
        return directory

    def train_arguments(self, node: int) -> list[str]:
        # one machine, two "pods": each node needs its own base port (on a cluster each pod has its own address)
        overrides = [f"logging.metrics_port={self.metrics_ports[node]}", *self.overrides]
        return train_arguments(Path(VOLUMES), {split: Path(VOLUMES) / "shards" / split for split in ("train", "val")},
                               overrides, resume="auto")

    def start(self, node: int, failpoint: str | None = None, once: str = FIRED, **env: str) -> Node:
        """Start (or replace) node ``node``; ``failpoint`` arms a fault in its ranks, once per job
        (per marker ``once``: two faults of one job need two); ``env``: more of its environment."""
        extra = {} if failpoint is None else {"INSTCLS_FAILPOINT": failpoint,
                                              "INSTCLS_FAILPOINT_ONCE": str(self.shared / once)}
        extra.update(env)
        started = start_node(node, self.node_directory(node), self.rendezvous, self.train_arguments(node),
                             env=job_env(**extra), repo=REPO)
        self.nodes.append(started)
        return started

    def wait(self, nodes: list[Node], timeout: float = 600) -> list[int | None]:
        """The exit codes of ``nodes``; one still running at the deadline is killed (code None)."""
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for node in nodes:
            try:
                codes.append(node.wait(max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:  # a hang is a result, not a crash of the drill
                node.lose()
                codes.append(None)
        return codes

    def __enter__(self) -> TwoNodeJob:
        return self

    def __exit__(self, *exc) -> None:
        stop_all(self.nodes)  # nothing outlives the drill, whatever happened in it

    def output(self) -> str:
        """Everything every agent printed, node by node, replacements included."""
        return "\n".join(f"--- node {node.index} (started {node.started:.1f}) ---\n{node.output()}"
                         for node in self.nodes)
