"""`instcls launch` gives torchrun the pod's grace period as its worker shutdown timeout: left at
torchrun's 30 s default, a SIGTERM'd job's workers are SIGKILLed in the middle of their checkpoint."""

from __future__ import annotations

import os
import signal

import pytest
from torch.distributed.run import get_args_parser

from trainer.parallel import launch as launch_module
from trainer.parallel.launch import GRACE_ENV, torchrun_command

ARGS = ["--nnodes=8", "--nproc-per-node=8", "-m", "trainer.cli", "train", "--config=job.yaml"]


def torchrun_settings(command: list[str]):
    assert command[1:3] == ["-m", "trainer.parallel.torchrun_agent"]  # torchrun, its agent patched
    return get_args_parser().parse_args(command[3:])


def test_launch_passes_the_grace_period_minus_a_margin_to_torchrun(monkeypatch):
    monkeypatch.setenv(GRACE_ENV, "600")
    started = []

    class FakeTorchrun:
        def __init__(self, command, env, stderr):
            started.append(command)
            self.stderr = child_stderr

        def wait(self):
            return 0

    monkeypatch.setattr(launch_module.subprocess, "Popen", FakeTorchrun)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    with open(os.devnull, "rb") as child_stderr:
        assert launch_module.launch(ARGS) == 0
    # The forwarding handlers go with torchrun: left behind, they would swallow a later SIGTERM of
    # this process or of anything it forks (a multiprocessing pool's workers then never stop).
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    (command,) = started
    settings = torchrun_settings(command)  # torchrun's own parser reads the flag
    assert settings.shutdown_timeout == 570 and settings.nproc_per_node == "8"
    assert command[-len(ARGS) + 2:] == ARGS[2:]


def test_an_explicit_flag_wins_and_no_grace_period_leaves_torchrun_alone():
    explicit = torchrun_command(["--shutdown-timeout=100", *ARGS], {GRACE_ENV: "600"})
    assert torchrun_settings(explicit).shutdown_timeout == 100
    assert not any("shutdown" in arg for arg in torchrun_command(ARGS, {}))


@pytest.mark.parametrize("value", ["10m", "30", ""])
def test_a_bad_grace_period_names_the_variable_and_the_fix(value):
    with pytest.raises(
        ValueError, match=f"{GRACE_ENV}=.* is invalid: set it to the pod's terminationGracePeriodSeconds"
    ):
        torchrun_command(ARGS, {GRACE_ENV: value})


def test_each_rendezvous_round_gets_a_fresh_store_unless_the_user_chose(tmp_path):
    """Across nodes the restart count is no common key prefix (a node restarted for another's loss
    does not count up), so `instcls launch` has torchrun's c10d rendezvous give every round its own store."""
    from trainer.exit_codes import EXIT_CODE_ENV
    from trainer.parallel.launch import FRESH_STORE_ENV, torchrun_environment

    environment = torchrun_environment(tmp_path, {"PATH": "/bin"})
    assert environment[FRESH_STORE_ENV] == "1" and environment[EXIT_CODE_ENV] == str(tmp_path)
    assert torchrun_environment(tmp_path, {FRESH_STORE_ENV: "0"})[FRESH_STORE_ENV] == "0"


def test_the_agent_stops_its_own_workers_with_the_shutdown_timeout_not_torch_s_30_s():
    """A membership change makes torch's agent stop its workers through ``_stop_workers``, which calls
    ``_shutdown()`` at its 30 s default whatever ``--shutdown-timeout`` says; `instcls launch`'s
    torchrun gives those stops the shutdown timeout too, so the save a node's return triggers can
    finish."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from trainer.parallel.torchrun_agent import patch_agent

    class Agent:  # what _stop_workers touches of an agent
        _shutdown_timeout = 570

        def __init__(self):
            self.timeouts = []

        def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
            self.timeouts.append(timeout)

    original, start = LocalElasticAgent._stop_workers, LocalElasticAgent._start_workers
    agent = Agent()
    original(agent, None)
    assert agent.timeouts == [30]  # torch's own: the fixed default
    try:
        patch_agent()
        LocalElasticAgent._stop_workers(agent, None)
    finally:
        LocalElasticAgent._stop_workers, LocalElasticAgent._start_workers = original, start
    assert agent.timeouts == [30, 570]


def test_the_agent_numbers_each_round_it_starts_and_tells_its_workers_the_shutdown_timeout(tmp_path, monkeypatch):
    """The launcher judges the newest round's exit reports only; a stopping rank's checkpoint retries
    keep within the shutdown timeout."""
    from trainer.exit_codes import EXIT_CODE_ENV, ROUND_ENV, newest_round
    from trainer.parallel import torchrun_agent
    from trainer.parallel.shutdown_clock import SHUTDOWN_TIMEOUT_ENV

    started = []
    monkeypatch.setattr(torchrun_agent, "_start_workers", lambda agent, group: started.append(
        (os.environ[ROUND_ENV], os.environ[SHUTDOWN_TIMEOUT_ENV])))
    for name in (EXIT_CODE_ENV, ROUND_ENV, SHUTDOWN_TIMEOUT_ENV):
        monkeypatch.setenv(name, str(tmp_path) if name == EXIT_CODE_ENV else "")

    class Agent:
        _shutdown_timeout = 570

    torchrun_agent._start_numbered_round(Agent(), None)
    torchrun_agent._start_numbered_round(Agent(), None)  # a membership change: the same restart count
    assert started == [("1", "570"), ("2", "570")] and newest_round(tmp_path) == 2


def test_the_launcher_process_never_imports_torch():
    """`instcls launch` is every pod's main process and starts at every pod start; its torchrun and the
    ranks import torch, the launcher itself need not (over a second of CPU each time).  A whole launch,
    of a worker that is `true`, end to end."""
    import subprocess
    import sys

    code = ("import sys; from trainer.cli import main; "
            "code = main(['launch', '--nproc-per-node', '1', '--master-port', '0', '--no-python', 'true']); "
            "print(code, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip().splitlines()[-1] == "0 []", result.stdout + result.stderr
