"""What cannot run on a 2-core machine, each replaced by a named equivalent and logged.

Only these change; everything else runs as the manifest has it (restarts, the rendezvous backend
and its configuration, the shutdown timeout, the grace period, the exit codes):

- the job's size: MAX nodes become 2 (an elastic MIN:MAX becomes 1:2, a ``successPolicy`` count
  of MIN becomes 1), processes per node become 1 (``PET_NPROC_PER_NODE=auto`` would otherwise
  turn into the CPU count), and an elastic overlay's per-GPU batch becomes one that 1 and 2 nodes
  both split;
- ``OMP_NUM_THREADS`` becomes 1;
- the cluster's names and ports (pod DNS names, the rendezvous port) become 127.0.0.1 and a free
  port of this machine.  Where torch decides from the endpoint's name which pod hosts the c10d store
  (an elastic PyTorchJob's ``PET_RDZV_ENDPOINT``: its own name resolves to itself on one pod only),
  every pod here would match 127.0.0.1, so the pod the name belongs to gets ``is_host=1`` in
  ``PET_RDZV_CONF`` and the others ``is_host=0``;
- the image's ``instcls`` entry point becomes this checkout's ``python -m trainer.cli``;
- mount paths become per-pod directories: a ConfigMap's files written there, an ``emptyDir`` a
  fresh directory, a claim a link to the one shared directory of that claim.  Arguments and the
  mounted files name them relative to the pod's working directory (every pod sees the same
  paths, as on the cluster); variables, absolute (``HOME`` must be);
- each pod gets its own metrics port, and the store and collective timeout becomes shorter
  (``parallel.collective_timeout_s``), so a hang ends within a drill's time.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

from trainer.drills.pods.manifest import ManifestError

KNOWN_COMMANDS = {"instcls": [sys.executable, "-m", "trainer.cli"]}
NODES, MIN_NODES = 2, 1


def scaled_nodes(value: str) -> str:
    """``8`` -> ``2``, ``4:8`` -> ``1:2``."""
    return f"{MIN_NODES}:{NODES}" if ":" in value else str(NODES)


@dataclass
class Changes:
    """The log of every change the harness made, one line each."""

    lines: list[str] = field(default_factory=list)

    def note(self, where: str, what: str) -> None:
        line = f"{where}: {what}"
        if line not in self.lines:
            self.lines.append(line)


def scale_objects(objects: list[dict], changes: Changes) -> None:
    """The workload objects resized to ``NODES`` nodes, in place."""
    for obj in objects:
        kind, name, spec = obj.get("kind"), obj.get("metadata", {}).get("name"), obj.get("spec", {})
        where = f"{kind} {name}"
        if kind == "Job" and spec.get("completionMode") == "Indexed":
            for key in ("completions", "parallelism"):
                changes.note(where, f"spec.{key} {spec[key]} -> {NODES}")
                spec[key] = NODES
            for rule in spec.get("successPolicy", {}).get("rules", []):
                if "succeededCount" in rule:
                    changes.note(where, f"successPolicy succeededCount {rule['succeededCount']} (MIN) -> {MIN_NODES}")
                    rule["succeededCount"] = MIN_NODES
        elif kind == "PyTorchJob":
            replicas = spec["pytorchReplicaSpecs"]
            workers = NODES - (1 if "Master" in replicas else 0)
            changes.note(where, f"Worker replicas {replicas['Worker']['replicas']} -> {workers}")
            replicas["Worker"]["replicas"] = workers
            if "elasticPolicy" in spec:
                policy = spec["elasticPolicy"]
                changes.note(where, f"elasticPolicy {policy['minReplicas']}:{policy['maxReplicas']} -> "
                                    f"{MIN_NODES}:{NODES}")
                policy.update(minReplicas=MIN_NODES, maxReplicas=NODES)
        elif kind == "TrainJob" and "numNodes" in spec.get("trainer", {}):
            changes.note(where, f"spec.trainer.numNodes {spec['trainer']['numNodes']} -> {NODES}")
            spec["trainer"]["numNodes"] = NODES
        elif kind == "ClusterTrainingRuntime":
            policy = spec.get("mlPolicy", {})
            if "numNodes" in policy:
                changes.note(where, f"mlPolicy.numNodes {policy['numNodes']} -> {NODES}")
                policy["numNodes"] = NODES


@dataclass(frozen=True)
class PodPlace:
    """Where a pod's paths and names point on this machine."""

    directory: object  # the attempt's working directory (pathlib.Path)
    mounts: dict[str, str]  # mount path -> the relative path it becomes
    endpoints: dict[str, str]  # cluster "host:port" -> "127.0.0.1:PORT"
    hosts: dict[str, str]  # cluster host -> 127.0.0.1
    ports: dict[str, str]  # cluster port -> local port
    metrics_port: int
    collective_timeout_s: int
    elastic_batch: int | None  # the per-rank batch an elastic overlay's override becomes
    store_host: bool  # the pod whose DNS name the rendezvous endpoint names


def rewrite_paths(text: str, mounts: dict[str, str], absolute_root: str | None = None) -> str:
    """``text`` with each mount path (a whole path prefix) replaced by its local path."""
    for mount in sorted(mounts, key=len, reverse=True):
        local = mounts[mount] if absolute_root is None else f"{absolute_root}/{mounts[mount]}"
        text = re.sub(rf"(?<![\w./-]){re.escape(mount)}(?=$|[/\s,;:=\"'])", local, text)
    return text


def environment(where: str, env: dict[str, str], place: PodPlace, changes: Changes) -> dict[str, str]:
    out = {}
    for name, value in env.items():
        new = value
        if value in place.endpoints:
            new = place.endpoints[value]
        elif value in place.hosts:
            new = place.hosts[value]
        elif name.endswith("_PORT") and value in place.ports:
            new = place.ports[value]
        elif name == "PET_NNODES":
            new = scaled_nodes(value)
        elif name == "PET_NPROC_PER_NODE" or name == "OMP_NUM_THREADS":
            new = "1"
        else:
            new = rewrite_paths(value, place.mounts, str(place.directory))
        if new != value:
            changes.note(where, f"env {name}={value} -> {new}")
        out[name] = new
    if "PET_RDZV_ENDPOINT" in out and "is_host" not in out.get("PET_RDZV_CONF", ""):
        conf = ",".join(filter(None, [out.get("PET_RDZV_CONF"), f"is_host={int(place.store_host)}"]))
        changes.note(where, f"env PET_RDZV_CONF={out.get('PET_RDZV_CONF', '')} -> {conf} (the endpoint's name "
                            f"{'is' if place.store_host else 'is not'} this pod's)")
        out["PET_RDZV_CONF"] = conf
    scratch = next((local for mount, local in place.mounts.items() if mount == "/tmp"), None)
    if scratch is not None:
        out["TMPDIR"] = f"{place.directory}/{scratch}"
        changes.note(where, "env TMPDIR set to the pod's /tmp volume (the host's /tmp is not the pod's)")
    return out


def _rewrite_option(argument: str, following: str | None, flags: tuple[str, ...], change) -> tuple[str, str | None]:
    flag, equals, value = argument.partition("=")
    if flag not in flags:
        return argument, following
    if equals:
        return f"{flag}={change(value)}", following
    return argument, None if following is None else change(following)


def arguments(where: str, argv: list[str], place: PodPlace, changes: Changes) -> list[str]:
    if argv[0] not in KNOWN_COMMANDS:
        raise ManifestError(f"{where}.command {argv[0]!r} is not a command the harness knows "
                            f"({sorted(KNOWN_COMMANDS)})")
    changes.note(where, f"command {argv[0]} -> {' '.join(KNOWN_COMMANDS[argv[0]])} (this checkout)")
    out = list(KNOWN_COMMANDS[argv[0]])
    rest = argv[1:]
    index = 0
    while index < len(rest):
        argument = rest[index]
        following = rest[index + 1] if index + 1 < len(rest) and not rest[index + 1].startswith("-") else None
        new, new_following = argument, following
        for flags, change in ((("--nnodes",), scaled_nodes), (("--nproc-per-node", "--nproc_per_node"), lambda v: "1")):
            new, new_following = _rewrite_option(new, new_following, flags, change)
        for endpoint, local in place.endpoints.items():
            new = new.replace(endpoint, local)
        new = rewrite_paths(new, place.mounts)
        if place.elastic_batch is not None and new.startswith("--set=data.loader.batch_size="):
            new = f"--set=data.loader.batch_size={place.elastic_batch}"
        if new != argument or new_following != following:
            changes.note(where, f"argument {argument}{' ' + following if following else ''} -> "
                                f"{new}{' ' + new_following if new_following else ''}")
        out.append(new)
        if following is not None and new_following != following:
            out.append(new_following)
            index += 1
        index += 1
    extra = [f"--set=logging.metrics_port={place.metrics_port}",
             f"--set=parallel.collective_timeout_s={place.collective_timeout_s}"]
    changes.note(where, f"arguments appended: {' '.join(extra[:1])} (each pod its own port) "
                        f"{extra[1]} (a hang ends within the drill)")
    return out + extra
