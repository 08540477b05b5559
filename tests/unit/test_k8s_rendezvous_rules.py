"""Rules every multi-node overlay's torchrun must keep, read from the command its pods run: the
container's own arguments and the variables its controller injects, as the pod drills' harness
builds them.

- A pod that restarts its workers in place (``--max-restarts`` above 0) needs a dynamic (c10d)
  rendezvous: under the static one a replaced pod starts at restart count 0 while its peers restart
  at 1, and the two sides wait under different store prefixes until the timeout.
- On an elastic overlay a returning node must not time out of the rendezvous while its peers stop
  for it: they may take the whole shutdown timeout (a save), then the last call; a minute more
  for the node's own start."""

import pytest

from trainer.drills.pods.cpu_job import job_config_map, nccl_config_map
from trainer.drills.pods.manifest import workload
from trainer.drills.pods.pod_environment import command_line, container_environment
from trainer.parallel.launch import torchrun_command
from trainer.parallel.torchrun_arguments import option_value

MULTI_NODE = ("indexed-job", "indexed-job-elastic", "pytorchjob", "pytorchjob-elastic", "trainjob")
MARGIN_S = 60


def _torchrun(overlay: str) -> tuple[list[str], dict[str, str]]:
    """Pod 0's torchrun command (its shutdown timeout filled in from the grace period) and environment."""
    found = workload(overlay)
    pod = found.pods[0]
    env = container_environment(overlay, pod.container, pod.injected, pod.name, pod.annotations, {},
                                {"instcls-job": job_config_map(), "instcls-nccl": nccl_config_map()}, {})
    argv = command_line(overlay, pod.container, env)
    assert argv[:2] == ["instcls", "launch"], argv
    command = torchrun_command(argv[2:], env)
    assert command[1:3] == ["-m", "trainer.parallel.torchrun_agent"], command
    return command[3:], env  # torchrun's own arguments


def _setting(command: list[str], env: dict[str, str], flag: str) -> str | None:
    """torchrun's value of ``--flag``: the argument, else its PET_ variable (as torchrun reads them)."""
    return option_value(command, f"--{flag}", f"--{flag.replace('-', '_')}") or \
        env.get("PET_" + flag.upper().replace("-", "_"))


@pytest.mark.parametrize("overlay", MULTI_NODE)
def test_workers_restarted_in_place_meet_in_a_c10d_rendezvous(overlay):
    command, env = _torchrun(overlay)
    restarts = int(_setting(command, env, "max-restarts") or 0)
    backend = _setting(command, env, "rdzv-backend") or "static"
    assert restarts == 0 or backend == "c10d", \
        f"{overlay}: --max-restarts={restarts} under the {backend} rendezvous: a replaced pod can never rejoin"
    if backend == "c10d":
        assert _setting(command, env, "rdzv-endpoint"), f"{overlay}: a c10d rendezvous without an endpoint"


@pytest.mark.parametrize("overlay", [name for name in MULTI_NODE if name.endswith("-elastic")])
def test_a_returning_node_outwaits_its_peers_save_and_the_last_call(overlay):
    command, env = _torchrun(overlay)
    conf = dict(entry.split("=", 1) for entry in (_setting(command, env, "rdzv-conf") or "").split(",") if entry)
    shutdown = int(option_value(command, "--shutdown-timeout"))
    join, last_call = int(conf.get("join_timeout", 600)), int(conf.get("last_call_timeout", 30))
    assert join >= shutdown + last_call + MARGIN_S, \
        f"{overlay}: join_timeout={join} < shutdown timeout {shutdown} + last_call_timeout {last_call} + {MARGIN_S}"
