"""Drills where a port the job needs is already taken: it must fail before any step with a
message naming the port."""

from __future__ import annotations

import socket
import subprocess
import time
from contextlib import contextmanager

from trainer.drills.context import FOUR_STEPS, DrillContext, DrillResult
from trainer.drills.jobs import LAUNCH, REPO, Job, job_env


@contextmanager
def taken_port():
    """A TCP port held by a listening socket for the duration of the block."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        yield holder.getsockname()[1]


def metrics_port_taken(context: DrillContext) -> DrillResult:
    job = Job(context.directory("metrics-port-taken"), context.shards)
    with taken_port() as port:
        started = time.time()
        result = job.run(FOUR_STEPS + [f"logging.metrics_port={port}"], resume="none")
        seconds = round(time.time() - started, 1)
    named = f":{port}, the port is in use" in result.stderr
    return DrillResult(
        "metrics-port-taken", f"logging.metrics_port {port} already bound on the node",
        f"exit {result.returncode} after {seconds} s, before any step; the error names the port: {named}",
        "none: no step ran", None,
        result.returncode != 0 and named and not any(r.get("event") == "step" for r in job.log_records()))


def rendezvous_port_taken(context: DrillContext) -> DrillResult:
    job = Job(context.directory("rendezvous-port-taken"), context.shards)
    with taken_port() as port:
        command = job.command(FOUR_STEPS, resume="none", launcher=LAUNCH)
        command[command.index("--master-port") + 1] = str(port)
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=job_env())
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    advised = "rendezvous port is taken" in last
    return DrillResult(
        "rendezvous-port-taken", f"--master-port {port} already bound",
        f"exit {result.returncode}; last line says what to change: {advised}", "none: no step ran", None,
        result.returncode != 0 and advised)
