"""An overlay's training pods run as local process groups, with their controller's part played
from the manifest (``controllers``): a pod that ends is replaced, counted or ignored as its policy
says, and the job ends as its controller would end it.

Each pod attempt runs the container's own command (``pod_environment``) with the CPU substitutions
(``cpu_substitutions``, every change logged in ``changes.txt``) in a directory of its own,
``pods/POD/attempt-K/``, which keeps the attempt's output (``output.txt``): a replaced pod's first
life is the evidence when a drill fails.  Claims are links to ``shared/CLAIM``, the one directory
every pod shares.

Faults a drill applies: ``kill`` (SIGKILL to the pod's processes: a node or container gone, exit
137), ``delete`` (SIGTERM to the container's main process, SIGKILL after the grace period, as
``kubectl delete pod``), ``preempt_all`` (the same to every pod, each with the ``DisruptionTarget``
condition), ``lose`` (a kill whose replacement cannot be scheduled until ``return_node``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.drills.jobs import REPO
from trainer.drills.pods import cpu_substitutions as cpu
from trainer.drills.pods.controllers import Action, PodEnd, controller_of
from trainer.drills.pods.manifest import ManifestError, PodTemplate, Workload
from trainer.drills.pods.pod_environment import command_line, container_environment
from trainer.drills.pods.pod_volumes import mount_volumes
from trainer.parallel.launch import free_port
from trainer.parallel.local_nodes import kill_tree, wait_for_output

IMAGE_ENV_DROPPED = ("PET_", "TORCHELASTIC_", "INSTCLS_FAILPOINT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                     "LOCAL_RANK", "GROUP_RANK", "KUBEFLOW_TRAINER_")


@dataclass
class Attempt:
    """One life of one pod."""

    pod: PodTemplate
    number: int
    directory: Path
    process: subprocess.Popen
    started: float = field(default_factory=time.time)
    code: int | None = None
    disrupted: bool = False
    deleted: bool = False
    terminating_since: float | None = None  # when it was sent SIGTERM (monotonic): SIGKILL after the grace period

    @property
    def output_file(self) -> Path:
        return self.directory / "output.txt"

    def output(self) -> str:
        return self.output_file.read_text(errors="replace") if self.output_file.exists() else ""

    def running(self) -> bool:
        return self.code is None and self.process.poll() is None

    def signal_main(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signum)

    def kill_all(self) -> None:
        """SIGKILL the container's every process."""
        kill_tree(self.process)

    def wait_for(self, text: str, timeout: float) -> bool:
        return wait_for_output(self.output, self.process, text, timeout)


@dataclass
class Event:
    time: float
    pod: str
    attempt: int
    code: int
    action: str
    reason: str


class LocalCluster:
    """``workload``'s pods on this machine.  ``config_maps``/``secrets``: the fixtures (name -> data);
    ``shared``: claim name -> what the shared directory of that claim links to or holds."""

    def __init__(self, workload: Workload, run_dir: Path, changes: cpu.Changes, config_maps: dict[str, dict[str, str]],
                 secrets: dict[str, dict[str, str]] | None = None, claims: dict[str, Path | None] | None = None,
                 collective_timeout_s: int = 60, elastic_batch: int | None = None,
                 status_server: dict[str, str] | None = None) -> None:
        """``status_server``: a TrainJob's status endpoint variables (``KUBEFLOW_TRAINER_SERVER_*``), which
        Trainer's ``TrainJobStatus`` feature gate injects; a test that serves the endpoint passes them."""
        if status_server and workload.kind != "TrainJob":
            raise ManifestError(f"{workload.kind} {workload.name}: only a TrainJob's pods get a status endpoint")
        self.status_server = dict(status_server or {})
        self.workload, self.run_dir, self.changes = workload, Path(run_dir), changes
        self.config_maps, self.secrets = config_maps, secrets or {}
        self.collective_timeout_s, self.elastic_batch = collective_timeout_s, elastic_batch
        self.shared = self.run_dir / "shared"
        for claim, target in (claims or {}).items():
            (self.shared / claim).mkdir(parents=True, exist_ok=True)
            for name, path in ({} if target is None else {p.name: p for p in Path(target).iterdir()}).items():
                link = self.shared / claim / name
                if not link.exists():
                    link.symlink_to(path)
        port = free_port()
        self.endpoints = {endpoint: f"127.0.0.1:{port}" for endpoint in workload.ports}
        self.hosts = {endpoint.rsplit(":", 1)[0]: "127.0.0.1" for endpoint in workload.ports}
        self.ports = {str(cluster_port): str(port) for cluster_port in workload.ports.values()}
        for endpoint, local in self.endpoints.items():
            changes.note("network", f"{endpoint} -> {local} (every pod's DNS name is this machine)")
        self.controller = controller_of(workload)
        self.attempts: dict[int, list[Attempt]] = {i: [] for i in range(len(workload.pods))}
        self.unschedulable: set[int] = set()
        self.events: list[Event] = []
        self.extra_env: dict[int, dict[str, str]] = {}
        self.outcome: str | None = None  # "Succeeded", "Failed: reason"

    # -- pods -----------------------------------------------------------------------------------
    def start(self, index: int) -> Attempt:
        pod = self.workload.pods[index]
        number = len(self.attempts[index])
        directory = self.run_dir / "pods" / pod.name / f"attempt-{number}"
        directory.mkdir(parents=True)
        mounts = mount_volumes(pod, directory, self.shared, self.config_maps, self.changes)
        store_host = any(endpoint.rsplit(":", 1)[0] in (pod.name, pod.dns_name) for endpoint in self.endpoints)
        place = cpu.PodPlace(directory.resolve(), mounts, self.endpoints, self.hosts, self.ports, free_port(),
                             self.collective_timeout_s, self.elastic_batch, store_host)
        where = f"pod {pod.name}"
        labels = pod.spec.get("labels", {})
        injected = [*pod.injected, *({"name": k, "value": v} for k, v in self.status_server.items())]
        env = container_environment(where, pod.container, injected, pod.name, pod.annotations, labels,
                                    self.config_maps, self.secrets)
        env = cpu.environment(where, env, place, self.changes)
        argv = cpu.arguments(where, command_line(where, pod.container, env), place, self.changes)
        image_env = {k: v for k, v in _base_environment().items() if not k.startswith(IMAGE_ENV_DROPPED)}
        full_env = {**image_env, **env, **self.extra_env.get(index, {})}
        (directory / "command.json").write_text(json.dumps({"argv": argv, "env": env,
                                                            "drill_env": self.extra_env.get(index, {})}, indent=1))
        with open(directory / "output.txt", "w") as output:
            process = subprocess.Popen(argv, cwd=directory, env=full_env, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        attempt = Attempt(pod, number, directory, process)
        self.attempts[index].append(attempt)
        (self.run_dir / "changes.txt").write_text("\n".join(self.changes.lines) + "\n")
        return attempt

    def start_all(self) -> None:
        for index in range(len(self.workload.pods)):
            self.start(index)

    def current(self, index: int) -> Attempt:
        return self.attempts[index][-1]

    # -- faults -----------------------------------------------------------------------------------
    def kill(self, index: int) -> None:
        self.current(index).kill_all()

    def lose(self, index: int) -> None:
        """The pod's node gone for good: killed, and its replacement pending until ``return_node``."""
        self.unschedulable.add(index)
        self.current(index).deleted = True
        self.kill(index)

    def return_node(self, index: int) -> None:
        self.unschedulable.discard(index)

    def delete(self, index: int, disrupted: bool = False) -> None:
        """SIGTERM to the container's main process; SIGKILL after the pod's grace period (see ``reconcile``)."""
        attempt = self.current(index)
        attempt.deleted, attempt.disrupted = True, disrupted
        attempt.terminating_since = time.monotonic()
        attempt.signal_main(signal.SIGTERM)

    def preempt_all(self) -> None:
        for index in self.attempts:
            if self.current(index).running():
                self.delete(index, disrupted=True)

    # -- the controller -------------------------------------------------------------------------------
    def _grace(self, attempt: Attempt) -> float:
        return float(attempt.pod.spec.get("terminationGracePeriodSeconds", 30))

    def reconcile(self) -> None:
        """Judge each pod that ended since the last call, and act as its controller would."""
        for index, attempts in self.attempts.items():
            attempt = attempts[-1] if attempts else None
            if attempt is None:
                continue
            since = attempt.terminating_since
            if since is not None and attempt.running() and time.monotonic() - since > self._grace(attempt):
                attempt.kill_all()
            if attempt.code is not None or attempt.process.poll() is None:
                continue
            attempt.code = _container_code(attempt.process.returncode)
            verdict = self.controller.judge(PodEnd(index, attempt.code, attempt.disrupted, attempt.deleted))
            self.events.append(Event(time.time(), attempt.pod.name, attempt.number, attempt.code,
                                     verdict.action.value, verdict.reason))
            if verdict.action is Action.FAIL_JOB:
                self.outcome = f"Failed: {verdict.reason}"
                self.terminate_all()
                return
            if verdict.action is Action.RESTART_ALL:
                self.terminate_all()
                self.start_all()
                return
        if self.outcome is None and self.controller.done(len(self.workload.pods)):
            self.outcome = "Succeeded"
        if self.outcome is None:
            for index, attempts in self.attempts.items():
                ended = attempts[-1].code is not None and attempts[-1].code != 0
                if ended and index not in self.unschedulable:
                    self.start(index)

    def terminate_all(self) -> None:
        for attempts in self.attempts.values():
            if attempts and attempts[-1].running():
                attempts[-1].kill_all()
        for attempts in self.attempts.values():
            if attempts and attempts[-1].code is None:
                attempts[-1].process.wait()
                attempts[-1].code = _container_code(attempts[-1].process.returncode)

    def run(self, timeout: float) -> str:
        """Reconcile until the job ends and no pod runs, or ``timeout``: the outcome ("Timeout" then)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.reconcile()
            running = any(a and a[-1].running() for a in self.attempts.values())
            if self.outcome is not None and not running:
                break
            time.sleep(0.2)
        else:
            self.outcome = f"Timeout after {timeout:.0f} s (outcome so far: {self.outcome})"
        self.terminate_all()
        self._write_record()
        return self.outcome

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.terminate_all()
        self._write_record()

    def _write_record(self) -> None:
        (self.run_dir / "events.json").write_text(json.dumps([e.__dict__ for e in self.events], indent=1))

    def codes(self) -> list[tuple[str, int, int | None]]:
        """(pod, attempt, exit code) of every attempt, in start order."""
        attempts = sorted((a for lives in self.attempts.values() for a in lives), key=lambda a: a.started)
        return [(a.pod.name, a.number, a.code) for a in attempts]

    def output(self) -> str:
        """Every attempt's output, in start order."""
        attempts = sorted((a for lives in self.attempts.values() for a in lives), key=lambda a: a.started)
        return "\n".join(f"--- {a.pod.name} attempt {a.number} (exit {a.code}) ---\n{a.output()}" for a in attempts)


def _container_code(returncode: int) -> int:
    """The code a container runtime reports: 128 + N for a process ended by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _base_environment() -> dict[str, str]:
    """The image's environment: this process's, with the checkout on the path (the image installs it)."""
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    return environ
