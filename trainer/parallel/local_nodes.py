"""Several nodes of one job on one machine: one `instcls launch` agent per "node", each in its own
working directory, joined by a c10d rendezvous on the loopback interface, as the pods of the
Indexed Job in ``k8s/`` are.

What a pod has of its own, each node has here: a working directory (relative paths resolve
against it), node-local scratch (``TMPDIR``), its own output file, and a process session, so that
a drill can kill a node's agent and its workers together as a lost node, or send its agent alone
the SIGTERM that Kubernetes sends a pod.  What pods share on volumes (shards, checkpoints, logs)
the caller passes as absolute paths.  Node 0 hosts the rendezvous store (``is_host``), as pod 0
does behind the headless service; a replacement node is simply a new ``start_node`` with the same
index, whose torchrun restart count starts at 0 as a new pod's does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

LAUNCH = [sys.executable, "-m", "trainer.cli", "launch"]
RDZV_ID = "instcls-local-nodes"


@dataclass(frozen=True)
class Rendezvous:
    """Where the agents meet and how patient they are."""

    port: int
    nnodes: int = 2
    min_nodes: int | None = None  # elastic: go on with as few as this many nodes (torchrun --nnodes MIN:MAX)
    nproc_per_node: int = 1
    max_restarts: int = 3
    join_timeout_s: int = 600
    # a node restarted for a membership change waits this long for the other nodes' agents
    last_call_s: int = 1
    # how long an agent lets its workers stop (a SIGTERM's save) before SIGKILL; None: torch's 30 s
    shutdown_timeout_s: int | None = None

    def agent_arguments(self, node: int) -> list[str]:
        """torchrun's arguments for ``node``: node 0 hosts the store at the endpoint."""
        conf = f"is_host={int(node == 0)},join_timeout={self.join_timeout_s},last_call_timeout={self.last_call_s}"
        nnodes = str(self.nnodes) if self.min_nodes is None else f"{self.min_nodes}:{self.nnodes}"
        return ["--nnodes", nnodes, "--nproc-per-node", str(self.nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", RDZV_ID,
                "--rdzv-conf", conf, "--max-restarts", str(self.max_restarts), "--local-addr", "127.0.0.1",
                *([] if self.shutdown_timeout_s is None else ["--shutdown-timeout", str(self.shutdown_timeout_s)])]


@dataclass
class Node:
    """One running agent (a pod): its process, its directory and what it printed."""

    index: int
    directory: Path
    process: subprocess.Popen
    output_file: Path
    started: float = field(default_factory=time.time)

    def output(self) -> str:
        return self.output_file.read_text(errors="replace") if self.output_file.exists() else ""

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def lose(self) -> None:
        """SIGKILL the agent and its workers together, as when the node's machine is gone."""
        kill_tree(self.process)

    def preempt(self) -> None:
        """SIGTERM to the agent only, as the kubelet sends it to a pod's main process."""
        self.process.send_signal(signal.SIGTERM)

    def wait_for(self, text: str, timeout: float) -> bool:
        """True once ``text`` appears in the node's output (False if the agent exits or time runs out)."""
        return wait_for_output(self.output, self.process, text, timeout)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and every process under it (torchrun starts each worker in a session of
    its own, so a process group is not enough), and reap it here: ``Popen`` takes a child that
    something else reaped for one that exited 0."""
    try:
        main = psutil.Process(process.pid)
        processes = [main, *main.children(recursive=True)]
    except psutil.NoSuchProcess:
        processes = []
    for found in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            found.kill()
    process.wait()
    psutil.wait_procs(processes[1:], timeout=30)


def wait_for_output(read, process: subprocess.Popen, text: str, timeout: float) -> bool:
    """True once ``text`` appears in ``read()`` (False if ``process`` exits first without it, or time runs out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in read():
            return True
        if process.poll() is not None:
            return text in read()
        time.sleep(0.1)
    return False


def start_node(index: int, directory: Path, rendezvous: Rendezvous, module_args: list[str],
               env: dict[str, str] | None = None, repo: Path | None = None) -> Node:
    """Start node ``index``'s agent running ``python -m MODULE_ARGS...`` on every local rank, in
    ``directory`` (created, with ``scratch/`` as its TMPDIR; a replacement agent in the same
    directory prints to a file of its own).  ``repo``, when given, is put on the workers'
    PYTHONPATH (the checkout under test rather than an installed copy)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "scratch").mkdir(exist_ok=True)
    environ = dict(os.environ if env is None else env, TMPDIR=str(directory / "scratch"))
    environ.setdefault("OMP_NUM_THREADS", "1")
    if repo is not None:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), environ.get("PYTHONPATH")]))
    command = [*LAUNCH, *rendezvous.agent_arguments(index), "-m", *module_args]
    output_file = directory / f"agent-{len(list(directory.glob('agent-*.txt')))}.txt"
    with open(output_file, "w") as output:
        process = subprocess.Popen(command, cwd=directory, env=environ, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    return Node(index, directory, process, output_file)


def stop_all(nodes: list[Node]) -> None:
    """Whatever is still running: gone (a test's or drill's clean-up)."""
    for node in nodes:
        if node.process.poll() is None:
            node.lose()
